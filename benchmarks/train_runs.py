"""Run `equiconvert train` subprocesses into a benchmark's folder: plan, execute, record, report failures.

The runner behind benchmarks/accuracy.py's grids and recipe tables. Each run has a folder OUT/<name>; a run
whose result.json exists is done, one with a checkpoint.pt but no result.json is resumed with --resume (so an
interrupted benchmark continues where it stopped), and finished runs made with other train arguments are
refused. Each `train` call appends its output to OUT/<name>/stdout.log and, when it wrote a result, one line
(wall time, processes) to OUT/<name>/benchmark_parts.jsonl, so a run resumed in several calls keeps its cost.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Protocol, TypeVar

REPO = Path(__file__).resolve().parent.parent


class PlannedRun(Protocol):
    """A run of a benchmark: its folder name, and the train arguments (beyond the pass-through ones) defining it."""

    @property
    def name(self) -> str: ...

    @property
    def fixed_args(self) -> tuple[str, ...]: ...


R = TypeVar("R", bound=PlannedRun)

COMMANDS_FILE = "commands.jsonl"  # one line per `run` or `table` invocation on this folder
RUN_FILE = "benchmark_run.json"  # per run: what the benchmark asked `equiconvert train` to do
PARTS_FILE = "benchmark_parts.jsonl"  # per run: one line per `train` call that wrote a result (wall time, processes)
LOG_FILE = "stdout.log"
LOG_TAIL_LINES = 15
# Arguments the benchmark sets for every run; passing them after `--` would contradict the grid.
MANAGED_ARGS = (
    "--model",
    "--group",
    "--dataset",
    "--data-dir",
    "--epsilon",
    "--seed",
    "--out",
    "--device",
    "--resume",
    "--overwrite",
)


def check_extra_args(extra: list[str], managed: tuple[str, ...] = MANAGED_ARGS) -> None:
    for arg in extra:
        option = arg.split("=", 1)[0]
        if option in managed:
            raise SystemExit(
                f"error: {option} is set by the benchmark for every run; give it before `--` "
                f"(or leave it out), not in the pass-through train arguments"
            )


def plan(
    runs: list[R], out: Path, extra: list[str], continue_stopped: bool = False
) -> tuple[list[R], list[R], list[R]]:
    """Split PlannedRuns into (done, to resume, to start). Refuses results made with other train arguments.

    With `continue_stopped`, a finished run that train stopped at its --time-limit (and left a
    checkpoint of) is resumed instead of counted as done.
    """
    done, resume, start, conflicts = [], [], [], []
    for run in runs:
        run_dir = out / run.name
        if (run_dir / "result.json").exists():
            recorded = read_json(run_dir / RUN_FILE)
            if recorded is not None and recorded.get("extra_args") != [*run.fixed_args, *extra]:
                conflicts.append(f"{run.name} (made with {shlex.join(recorded.get('extra_args', []))!r})")
            timed_out = (read_json(run_dir / "result.json") or {}).get("stopped_reason") == "time_limit"
            if continue_stopped and timed_out and (run_dir / "checkpoint.pt").exists():
                resume.append(run)
            else:
                done.append(run)
        elif (run_dir / "checkpoint.pt").exists():
            resume.append(run)
        else:
            start.append(run)
    if conflicts:
        raise SystemExit(
            "error: these finished runs used other train arguments than "
            f"{shlex.join(extra)!r} (after their own); use another --out:\n  " + "\n  ".join(conflicts)
        )
    return done, resume, start


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def shown_command(script: str, argv: list[str]) -> str:
    """The command line as typed (python SCRIPT ARGV...), with paths below the working directory made relative."""
    cwd = Path.cwd()

    def rel(text: str) -> str:
        try:
            return str(Path(text).relative_to(cwd)) if os.path.isabs(text) else text
        except ValueError:
            return text

    return shlex.join([rel(sys.executable), rel(script), *argv])


def git_commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


class Printer:
    def __init__(self, total: int) -> None:
        self.total, self.count, self.lock = total, 0, threading.Lock()

    def __call__(self, text: str, finished: bool = False) -> None:
        with self.lock:
            self.count += finished
            print(f"[{self.count}/{self.total}] {text}", flush=True)


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def execute(
    name: str,
    run_dir: Path,
    cmd: list[str],
    record: dict,
    resume: bool,
    say: Printer,
    where: str,
    env: dict[str, str] | None = None,
) -> dict | None:
    """One `train` call in a subprocess (record: what RUN_FILE says of the run); None on success, else a failure."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        if (run_dir / "log.jsonl").exists():  # a failed attempt's log: keep it, but out of the way
            (run_dir / "log.jsonl").replace(run_dir / "log.failed-attempt.jsonl")
        (run_dir / PARTS_FILE).unlink(missing_ok=True)
    record = {**record, "command": shlex.join(cmd), "started": utc_now(), "resumed": resume}
    (run_dir / RUN_FILE).write_text(json.dumps(record, indent=2))
    say(f"{'resume' if resume else 'start'} {name} on {where}")
    before = _mtime(run_dir / "result.json")
    with open(run_dir / LOG_FILE, "a") as log:
        log.write(f"=== {utc_now()} {shlex.join(cmd)}\n")
        log.flush()
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        full_env = {**os.environ, **(env or {}), "PYTHONPATH": path}
        code = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env
        ).returncode
    result = read_json(run_dir / "result.json")
    if result is not None and _mtime(run_dir / "result.json") != before:  # this call's part of the run
        part = {k: result.get(k) for k in ("wall_time_s", "world_size", "steps", "stopped_reason")}
        with open(run_dir / PARTS_FILE, "a") as parts:
            parts.write(json.dumps({**part, "finished": utc_now()}) + "\n")
    if code == 0 and result is not None:
        stopped = f", stopped: {result['stopped_reason']}" if result.get("stopped_reason") else ""
        say(
            f"done  {name}: test accuracy {100 * result.get('test_accuracy', math.nan):.2f}%, "
            f"{result.get('wall_time_s', math.nan):.0f} s{stopped}",
            finished=True,
        )
        return None
    why = f"exit status {code}" if code != 0 else "exit status 0 but no result.json"
    say(f"FAILED {name} ({why}); log: {run_dir / LOG_FILE}", finished=True)
    return {"run": name, "why": why, "log": str(run_dir / LOG_FILE), "tail": _tail(run_dir / LOG_FILE)}


def print_failures(failures: list[dict], total: int) -> bool:
    """Name each failed run with the end of its log; True if any failed."""
    if failures:
        print(f"\n{len(failures)} of {total} runs FAILED:", file=sys.stderr)
        for f in failures:
            print(f"--- {f['run']}: {f['why']} (log: {f['log']})", file=sys.stderr)
            if f["tail"]:
                print("    " + f["tail"].replace("\n", "\n    "), file=sys.stderr)
    return bool(failures)


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def log_invocation(out: Path, script: str, argv: list[str], **fields: Any) -> None:
    """Append this invocation (command, commit, what it asked for) to OUT/COMMANDS_FILE."""
    invocation = {
        "date": utc_now(),
        "command": shown_command(script, argv),
        "argv": argv,
        "cwd": str(Path.cwd()),
        "git_commit": git_commit(),
        **fields,
    }
    with open(out / COMMANDS_FILE, "a") as handle:
        handle.write(json.dumps(invocation) + "\n")


def invocations(out: Path) -> list[dict]:
    """The invocations recorded in OUT, one entry per distinct command (a resumed grid repeats it)."""
    commands: list[dict] = []
    if (out / COMMANDS_FILE).exists():
        for line in (out / COMMANDS_FILE).read_text().splitlines():
            record = json.loads(line) if line.strip() else None
            if record and all(record["command"] != c["command"] for c in commands):
                commands.append(record)
    return commands


def read_parts(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / PARTS_FILE).read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]
