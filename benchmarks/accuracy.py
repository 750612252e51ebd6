"""Accuracy benchmark: the paper's table (test accuracy vs epsilon, per group) for any model.

    .venv/bin/python benchmarks/accuracy.py run --dataset fashion-mnist --model equiconvert:resnet9 \\
        --groups none,D1,D4 --epsilons 1,3,8 --seeds 0,1,2 --out benchmarks/results/accuracy/NAME \\
        [--data-dir DIR] [--devices cuda:0,cuda:1 --jobs-per-device 2] -- --steps 1000 --batch-size 2048
    .venv/bin/python benchmarks/accuracy.py report --out benchmarks/results/accuracy/NAME
    .venv/bin/python benchmarks/accuracy.py table cifar10_paper --data-dir DIR --out runs/cifar10_paper \\
        --nproc-per-node 4 [--time-limit SECONDS] [--cells d4_eps8,...] -- --set dp.precision=bf16

`run` trains nothing itself: every (group, epsilon, seed) of the grid is one subprocess
`python -m equiconvert train ... --out OUT/<run-name>` with the arguments after `--` passed through
verbatim, so every run uses the same schedule. Runs go in parallel over device slots (each device
listed in --devices, --jobs-per-device times). A run whose result.json exists is skipped, one with a
checkpoint.pt but no result.json is continued with --resume, so an interrupted grid resumes where it
stopped. Each run's stdout/stderr goes to OUT/<run-name>/stdout.log. A failed run does not stop the
others; it is reported at the end (name and the last lines of its log) and the exit status is 1.

`report` (also the last step of `run`) reads OUT/*/result.json, groups the runs by (dataset, model,
group, epsilon) and writes OUT/summary.json, OUT/table.md (median ± std over seeds, in percent, with
parameters and wall time; for runs trained with `--test-shifts SET`, a second table of the shift-averaged
accuracy) and OUT/accuracy_vs_epsilon.png. Runs that stopped before the requested
number of steps (privacy budget, time limit) are marked in the table, never mixed in silently.

`table NAME|FILE` trains the cells of a recipe table (equiconvert/recipes/tables/*.toml: recipe, --set
overrides, seeds, the paper's number), every cell's first seed before any cell's second, each run one
`equiconvert train --recipe ... --nproc-per-node N`, one after another (or side by side over --gpus). It
resumes like `run`, and also continues runs that a time limit stopped. --time-limit is a budget for the whole
invocation: each run gets what is left less --startup-margin, none starts with less than MIN_TRAIN_S of
training left, and the exit status 3 names the unfinished cells (run the same command again to go on). Its
report (benchmarks/paper_table.py) writes OUT/summary.json in the results page's paper_table schema,
OUT/table.md and OUT/accuracy_vs_epsilon.png.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import queue
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, also when loaded by path
import paper_table  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BASELINE = "none"
BASELINE_LABEL = "none (unconverted)"
COMMANDS_FILE = "commands.jsonl"  # one line per `run` or `table` invocation on this folder
RUN_FILE = "benchmark_run.json"  # per run: what the benchmark asked `equiconvert train` to do
PARTS_FILE = "benchmark_parts.jsonl"  # per run: one line per `train` call that wrote a result (wall time, processes)
TABLE_FILE = "table.json"  # a table's folder: its definition (labels, paper numbers) as last invoked
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
# result.json fields that, when set, say why a run stopped before its requested steps.
STOP_FIELDS = ("stopped_reason", "stop_reason")
REQUESTED_STEP_FIELDS = ("requested_steps", "steps_requested", "target_steps")
EARLY_MARK = "†"
SHIFT_AVERAGED = "test_accuracy_shift_averaged"  # result.json of a `train --test-shifts SET` run


# --- the grid ------------------------------------------------------------------------------------


def _fmt_eps(epsilon: float) -> str:
    return f"{epsilon:g}"


def run_name(dataset: str, model: str, group: str, epsilon: float, seed: int) -> str:
    """A folder name for one run: letters, digits, '.', '_' and '-' only."""
    raw = f"{dataset}_{model}_{group}_eps{_fmt_eps(epsilon)}_seed{seed}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw)


@dataclass(frozen=True)
class Run:
    dataset: str
    model: str
    group: str
    epsilon: float
    seed: int

    @property
    def name(self) -> str:
        return run_name(self.dataset, self.model, self.group, self.epsilon, self.seed)

    @property
    def fixed_args(self) -> tuple[str, ...]:
        """Train arguments of this run beyond the pass-through ones that define it (a grid's are in its name)."""
        return ()


@dataclass(frozen=True)
class TableRun:
    """One seed of one cell of a recipe table."""

    cell: Any  # equiconvert.recipes.table.Cell
    seed: int

    @property
    def name(self) -> str:
        return paper_table.run_name(self.cell.name, self.seed)

    @property
    def fixed_args(self) -> tuple[str, ...]:
        return (*self.cell.train_args(), "--seed", str(self.seed))


def build_grid(dataset: str, model: str, groups: list[str], epsilons: list[float], seeds: list[int]) -> list[Run]:
    runs = [Run(dataset, model, g, e, s) for g in groups for e in epsilons for s in seeds]
    names = [r.name for r in runs]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise SystemExit(f"error: the grid gives the same run name twice: {', '.join(clashes)}")
    return runs


def check_extra_args(extra: list[str], managed: tuple[str, ...] = MANAGED_ARGS) -> None:
    for arg in extra:
        option = arg.split("=", 1)[0]
        if option in managed:
            raise SystemExit(
                f"error: {option} is set by the benchmark for every run; give it before `--` "
                f"(or leave it out), not in the pass-through train arguments"
            )


def train_command(
    run: Run, out_dir: Path, device: str, data_dir: str | None, extra: list[str], resume: bool
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "equiconvert",
        "train",
        "--model",
        run.model,
        "--group",
        run.group,
        "--dataset",
        run.dataset,
    ]
    if data_dir is not None:
        cmd += ["--data-dir", data_dir]
    cmd += [
        "--epsilon",
        _fmt_eps(run.epsilon),
        "--seed",
        str(run.seed),
        "--out",
        str(out_dir),
        "--set",
        "run.progress=false",
        *extra,
        "--device",
        device,
    ]
    return cmd + (["--resume"] if resume else ["--overwrite"])  # a start replaces what a killed start left


def plan(
    runs: list[Run], out: Path, extra: list[str], continue_stopped: bool = False
) -> tuple[list[Run], list[Run], list[Run]]:
    """Split the grid into (done, to resume, to start). Refuses results made with other train arguments.

    With `continue_stopped`, a finished run that train stopped at its --time-limit (and left a
    checkpoint of) is resumed instead of counted as done.
    """
    done, resume, start, conflicts = [], [], [], []
    for run in runs:
        run_dir = out / run.name
        if (run_dir / "result.json").exists():
            recorded = _read_json(run_dir / RUN_FILE)
            if recorded is not None and recorded.get("extra_args") != [*run.fixed_args, *extra]:
                conflicts.append(f"{run.name} (made with {shlex.join(recorded.get('extra_args', []))!r})")
            timed_out = (_read_json(run_dir / "result.json") or {}).get("stopped_reason") == "time_limit"
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


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def _shown_command(argv: list[str]) -> str:
    """The command line as typed, with paths below the working directory made relative."""
    cwd = Path.cwd()

    def rel(text: str) -> str:
        try:
            return str(Path(text).relative_to(cwd)) if os.path.isabs(text) else text
        except ValueError:
            return text

    return shlex.join([rel(sys.executable), rel(__file__), *argv])


def _git_commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


class _Printer:
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


def _execute(
    name: str,
    run_dir: Path,
    cmd: list[str],
    record: dict,
    resume: bool,
    say: _Printer,
    where: str,
    env: dict[str, str] | None = None,
) -> dict | None:
    """One `train` call in a subprocess (record: what RUN_FILE says of the run); None on success, else a failure."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        if (run_dir / "log.jsonl").exists():  # a failed attempt's log: keep it, but out of the way
            (run_dir / "log.jsonl").replace(run_dir / "log.failed-attempt.jsonl")
        (run_dir / PARTS_FILE).unlink(missing_ok=True)
    record = {**record, "command": shlex.join(cmd), "started": _now(), "resumed": resume}
    (run_dir / RUN_FILE).write_text(json.dumps(record, indent=2))
    say(f"{'resume' if resume else 'start'} {name} on {where}")
    before = _mtime(run_dir / "result.json")
    with open(run_dir / LOG_FILE, "a") as log:
        log.write(f"=== {_now()} {shlex.join(cmd)}\n")
        log.flush()
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        full_env = {**os.environ, **(env or {}), "PYTHONPATH": path}
        code = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env
        ).returncode
    result = _read_json(run_dir / "result.json")
    if result is not None and _mtime(run_dir / "result.json") != before:  # this call's part of the run
        part = {k: result.get(k) for k in ("wall_time_s", "world_size", "steps", "stopped_reason")}
        with open(run_dir / PARTS_FILE, "a") as parts:
            parts.write(json.dumps({**part, "finished": _now()}) + "\n")
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


def _grid_job(
    run: Run, out: Path, device: str, data_dir: str | None, extra: list[str], resume: bool, say: _Printer
) -> dict | None:
    cmd = train_command(run, out / run.name, device, data_dir, extra, resume)
    record = {
        "run": run.name,
        "dataset": run.dataset,
        "model": run.model,
        "group": run.group,
        "epsilon": run.epsilon,
        "seed": run.seed,
        "device": device,
        "extra_args": extra,
    }
    return _execute(run.name, out / run.name, cmd, record, resume, say, device)


def run_grid(args: argparse.Namespace, extra: list[str], argv: list[str]) -> int:
    check_extra_args(extra)
    groups, epsilons, seeds = (
        _split(args.groups),
        [float(e) for e in _split(args.epsilons)],
        [int(s) for s in _split(args.seeds)],
    )
    devices = _split(args.devices)
    if not groups or not epsilons or not seeds or not devices or args.jobs_per_device < 1:
        raise SystemExit(
            "error: --groups, --epsilons, --seeds and --devices need at least one value, --jobs-per-device at least 1"
        )
    out = Path(args.out)
    runs = build_grid(args.dataset, args.model, groups, epsilons, seeds)
    done, to_resume, to_start = plan(runs, out, extra, args.continue_stopped)
    out.mkdir(parents=True, exist_ok=True)
    _log_invocation(out, argv, devices=devices, groups=groups, epsilons=epsilons, seeds=seeds, extra_args=extra)
    print(
        f"{len(runs)} runs: {len(done)} done (skipped), {len(to_resume)} to resume, {len(to_start)} to start; "
        f"{len(devices) * args.jobs_per_device} at a time on {', '.join(devices)}",
        flush=True,
    )

    slots: queue.Queue[str] = queue.Queue()
    for _ in range(args.jobs_per_device):
        for device in devices:
            slots.put(device)
    say = _Printer(len(to_resume) + len(to_start))

    def job(run: Run, resume: bool) -> dict | None:
        device = slots.get()
        try:
            return _grid_job(run, out, device, args.data_dir, extra, resume, say)
        except Exception as exc:  # the benchmark's own error (disk, permissions): still one failed run
            return {"run": run.name, "why": f"{type(exc).__name__}: {exc}", "log": "", "tail": ""}
        finally:
            slots.put(device)

    work = [(r, True) for r in to_resume] + [(r, False) for r in to_start]
    with ThreadPoolExecutor(max_workers=slots.qsize()) as pool:
        failures = [f for f in pool.map(lambda item: job(*item), work) if f is not None]

    report(out, argv=argv)
    return 1 if _print_failures(failures, len(work)) else 0


def _print_failures(failures: list[dict], total: int) -> bool:
    """Name each failed run with the end of its log; True if any failed."""
    if failures:
        print(f"\n{len(failures)} of {total} runs FAILED:", file=sys.stderr)
        for f in failures:
            print(f"--- {f['run']}: {f['why']} (log: {f['log']})", file=sys.stderr)
            if f["tail"]:
                print("    " + f["tail"].replace("\n", "\n    "), file=sys.stderr)
    return bool(failures)


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _log_invocation(out: Path, argv: list[str], **fields: Any) -> None:
    invocation = {
        "date": _now(),
        "command": _shown_command(argv),
        "argv": argv,
        "cwd": str(Path.cwd()),
        "git_commit": _git_commit(),
        **fields,
    }
    with open(out / COMMANDS_FILE, "a") as handle:
        handle.write(json.dumps(invocation) + "\n")


# --- recipe tables -------------------------------------------------------------------------------

# a table's cells set these through their recipes, or the benchmark sets them per run
TABLE_MANAGED_ARGS = (*MANAGED_ARGS, "--recipe", "--time-limit", "--nproc-per-node")
TABLE_MANAGED_KEYS = (
    "model.name",
    "conversion.group",
    "data.dataset",
    "data.data_dir",
    "dp.epsilon",
    "dp.target_epsilon",
    "schedule.seed",
    "run.out",
    "run.device",
    "run.time_limit_s",
    "run.resume",
    "run.overwrite",
)
STARTUP_MARGIN_S = 120.0  # per run, of a --time-limit budget: start-up, final evaluation and saving
MIN_TRAIN_S = 60.0  # a run starts only with at least this much training time left in the budget
UNFINISHED_EXIT = 3


@dataclass
class Slot:
    """Where one run of a table trains: a label for messages, and the environment that picks its cards."""

    label: str
    env: dict[str, str]


def table_slots(gpus: list[str], nproc: int, device: str | None) -> list[Slot]:
    """One slot (every visible card) without --gpus; else one slot per --nproc-per-node cards of --gpus."""
    if not gpus:
        return [Slot(device or "train's default device", {})]
    if len(gpus) % nproc:
        raise SystemExit(f"error: --gpus lists {len(gpus)} cards, not a multiple of --nproc-per-node {nproc}")
    if device not in (None, "cuda"):
        raise SystemExit(f"error: --device {device} with --gpus: each run sees its own cards; give --device cuda")
    groups = [",".join(gpus[i : i + nproc]) for i in range(0, len(gpus), nproc)]
    return [Slot(f"cards {g}", {"CUDA_VISIBLE_DEVICES": g}) for g in groups]


def check_table_extra_args(extra: list[str], cells: list[Any]) -> None:
    """Refuse pass-through arguments that would change what the table's cells define."""
    check_extra_args(extra, TABLE_MANAGED_ARGS)
    cell_keys = {o.split("=", 1)[0].strip() for c in cells for o in c.overrides}
    for i, arg in enumerate(extra):
        value = extra[i + 1] if arg == "--set" and i + 1 < len(extra) else arg.removeprefix("--set=")
        if arg != "--set" and not arg.startswith("--set="):
            continue
        key = value.split("=", 1)[0].strip()
        if key in TABLE_MANAGED_KEYS or key in cell_keys:
            raise SystemExit(
                f"error: --set {value}: {key} is set by the table's cells or by the benchmark for every run; "
                "a table row with another value is a cell of its own (add it to the table file)"
            )


def table_command(
    run: TableRun,
    run_dir: Path,
    data_dir: str | None,
    extra: list[str],
    device: str | None,
    nproc: int,
    time_limit: float | None,
    resume: bool,
) -> list[str]:
    cmd = [sys.executable, "-m", "equiconvert", "train", *run.fixed_args]
    if data_dir is not None:
        cmd += ["--data-dir", data_dir]
    cmd += ["--out", str(run_dir), "--set", "run.progress=false", *extra]
    cmd += ["--device", device] if device is not None else []
    cmd += ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd += ["--time-limit", f"{time_limit:g}"] if time_limit is not None else []
    return cmd + (["--resume"] if resume else ["--overwrite"])


def _load_table(name: str) -> Any:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from equiconvert.recipes.table import TableError, load_table

    try:
        return load_table(name)
    except TableError as exc:
        raise SystemExit(f"error: {exc}") from None


def table_runs(cells: list[Any]) -> list[TableRun]:
    """Every cell's first seed in table order, then every cell's second, ...: the table fills in row by row."""
    rounds = max(len(c.seeds) for c in cells)
    return [TableRun(c, c.seeds[i]) for i in range(rounds) for c in cells if i < len(c.seeds)]


def run_table(args: argparse.Namespace, extra: list[str], argv: list[str]) -> int:
    table = _load_table(args.table)
    try:
        cells = list(table.select(_split(args.cells)) if args.cells else table.cells)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    check_table_extra_args(extra, cells)
    if args.nproc_per_node < 1:
        raise SystemExit(f"error: --nproc-per-node {args.nproc_per_node}: give at least 1")
    slots_list = table_slots(_split(args.gpus or ""), args.nproc_per_node, args.device)
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    out = Path(args.out)
    runs = table_runs(cells)
    done, to_resume, _ = plan(runs, out, extra, continue_stopped=True)
    resuming = {r.name for r in to_resume}
    work = [r for r in runs if r not in done]
    out.mkdir(parents=True, exist_ok=True)
    (out / TABLE_FILE).write_text(json.dumps(paper_table.definition(table), indent=2))
    _log_invocation(out, argv, table=table.source, cells=[c.name for c in cells], extra_args=extra)
    print(
        f"table {table.source}: {len(runs)} runs of {len(cells)} cells: {len(done)} done (skipped), "
        f"{len(resuming)} to resume, {len(work) - len(resuming)} to start; "
        f"{len(slots_list)} at a time ({', '.join(s.label for s in slots_list)})",
        flush=True,
    )
    slots: queue.Queue[Slot] = queue.Queue()
    for slot in slots_list:
        slots.put(slot)
    say = _Printer(len(work))

    def job(run: TableRun) -> dict | None:
        slot = slots.get()
        try:
            limit = None if deadline is None else deadline - time.monotonic() - args.startup_margin
            if limit is not None and limit < MIN_TRAIN_S:
                return {"run": run.name, "skipped": True}
            resume = run.name in resuming
            cmd = table_command(
                run, out / run.name, args.data_dir, extra, args.device, args.nproc_per_node, limit, resume
            )
            record = {
                "run": run.name,
                "cell": run.cell.name,
                "recipe": run.cell.recipe,
                "overrides": list(run.cell.overrides),
                "seed": run.seed,
                "epsilon": run.cell.epsilon,
                "extra_args": [*run.fixed_args, *extra],
                "pass_through": extra,
                "nproc_per_node": args.nproc_per_node,
                "device": args.device,
                "slot": slot.label,
                "time_limit_s": limit,
            }
            return _execute(run.name, out / run.name, cmd, record, resume, say, slot.label, slot.env)
        except Exception as exc:  # the benchmark's own error (disk, permissions): still one failed run
            return {"run": run.name, "why": f"{type(exc).__name__}: {exc}", "log": "", "tail": ""}
        finally:
            slots.put(slot)

    with ThreadPoolExecutor(max_workers=len(slots_list)) as pool:
        outcomes = [o for o in pool.map(job, work) if o is not None]
    failures = [o for o in outcomes if not o.get("skipped")]
    report(out, argv=argv)
    failed = _print_failures(failures, len(work))
    _, resume_left, start_left = plan(runs, out, extra, continue_stopped=True)
    left = {r.name for r in [*resume_left, *start_left]}
    if not left:
        return 1 if failed else 0
    unfinished = []
    for cell in cells:
        seeds = [str(s) for s in cell.seeds if paper_table.run_name(cell.name, s) in left]
        if seeds:
            unfinished.append(f"{cell.name} (seed {', '.join(seeds)})")
    skipped = sum(bool(o.get("skipped")) for o in outcomes)
    why = (
        f"; {skipped} not started: less than {MIN_TRAIN_S:.0f} s of training left in --time-limit "
        f"{args.time_limit:g} after the {args.startup_margin:g} s start-up margin"
        if skipped
        else ""
    )
    print(
        f"unfinished cells: {'; '.join(unfinished)}{why}. Run the same command again to continue them.",
        file=sys.stderr,
    )
    return 1 if failed else UNFINISHED_EXIT


# --- the report ----------------------------------------------------------------------------------


def _requested_steps(result: dict, recorded: dict | None) -> int | None:
    for field in REQUESTED_STEP_FIELDS:
        if isinstance(result.get(field), int):
            return result[field]
    extra = (recorded or {}).get("extra_args", [])
    for i, arg in enumerate(extra):
        if arg == "--steps" and i + 1 < len(extra):
            return int(extra[i + 1])
        if arg.startswith("--steps="):
            return int(arg.split("=", 1)[1])
    return None


def _stop_reason(run_dir: Path, result: dict) -> str | None:
    for field in STOP_FIELDS:
        if field in result:  # train's own answer (None: ran to the end); the log may hold a resumed run's old stop
            return None if result[field] is None else str(result[field])
    try:
        lines = (run_dir / "log.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "stopped":
            return str(event.get("reason", "stopped"))
    return None


def load_runs(out: Path) -> list[dict]:
    """Every OUT/*/result.json, with its run name, seed and early-stop information added."""
    runs = []
    for path in sorted(out.glob("*/result.json")):
        result = _read_json(path)
        if not isinstance(result, dict) or "test_accuracy" not in result:
            print(f"warning: skipping {path}: not a result record", file=sys.stderr)
            continue
        recorded = _read_json(path.parent / RUN_FILE)
        requested = _requested_steps(result, recorded)
        reason = _stop_reason(path.parent, result)
        steps = result.get("steps")
        if reason is None and requested is not None and isinstance(steps, int) and steps < requested:
            reason = "fewer steps than requested"
        runs.append(
            {
                **result,
                "run": path.parent.name,
                "seed": result.get("seed", (recorded or {}).get("seed")),
                "target_epsilon": result.get("target_epsilon", (recorded or {}).get("epsilon")),
                "requested_steps": requested,
                "stopped_early": reason,
                "finished": _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.timezone.utc).date().isoformat(),
            }
        )
    return runs


def _common(values: list):
    """The value if all runs agree, else the sorted distinct values (so a mix is visible)."""
    distinct = sorted({json.dumps(v) for v in values})
    return json.loads(distinct[0]) if len(distinct) == 1 else [json.loads(v) for v in distinct]


def _group_key(group: str) -> tuple:
    if group.lower() == BASELINE:
        return (0, "", 0, group)
    match = re.fullmatch(r"([A-Za-z]+)(\d*)", group)
    return (1, match.group(1), int(match.group(2) or 0), group) if match else (2, group, 0, group)


def summarize(runs: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["dataset"], r["model"], r["group"], r["target_epsilon"]), []).append(r)
    summary = []
    for (dataset, model, group, epsilon), members in sorted(
        cells.items(), key=lambda item: (item[0][0], item[0][1], _group_key(item[0][2]), item[0][3] or 0)
    ):
        members.sort(key=lambda r: (r["seed"] is None, r["seed"], r["run"]))
        acc = [r["test_accuracy"] for r in members]
        averaged = [r for r in members if isinstance(r.get(SHIFT_AVERAGED), (int, float))]
        summary.append(
            {
                "dataset": dataset,
                "model": model,
                "group": group,
                "epsilon": epsilon,
                "n": len(members),
                "accuracy_median": statistics.median(acc),
                "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else None,  # sample std (n - 1)
                "accuracy_min": min(acc),
                "accuracy_max": max(acc),
                "brier_median": _median(members, "brier"),
                "ece_median": _median(members, "ece"),
                # `train --test-shifts SET` runs: the same statistics of the shift-averaged accuracy, over the runs that have it
                "test_shifts": _common([r.get("test_shifts") for r in averaged]) if averaged else None,
                "shift_averaged_n": len(averaged),
                "shift_averaged_accuracy_median": _median(averaged, SHIFT_AVERAGED),
                "shift_averaged_accuracy_std": statistics.stdev(r[SHIFT_AVERAGED] for r in averaged)
                if len(averaged) > 1
                else None,
                "epsilon_spent_max": max((r.get("epsilon", math.nan) for r in members), default=None),
                "delta": _common([r.get("delta") for r in members]),
                "params": _common([r.get("params") for r in members]),
                "params_before": _common([r.get("params_before") for r in members]),
                "wall_time_s_median": _median(members, "wall_time_s"),
                "device": _common([r.get("device") for r in members]),
                "steps": _common([r.get("steps") for r in members]),
                "requested_steps": _common([r["requested_steps"] for r in members]),
                "batch_size": _common([r.get("batch_size") for r in members]),
                "aug_mult": _common([r.get("aug_mult") for r in members]),
                "stopped_early": [
                    {
                        "run": r["run"],
                        "steps": r.get("steps"),
                        "requested_steps": r["requested_steps"],
                        "reason": r["stopped_early"],
                    }
                    for r in members
                    if r["stopped_early"]
                ],
                "runs": [
                    {
                        "run": r["run"],
                        "seed": r["seed"],
                        "test_accuracy": r["test_accuracy"],
                        SHIFT_AVERAGED: r.get(SHIFT_AVERAGED),
                        "brier": r.get("brier"),
                        "ece": r.get("ece"),
                        "epsilon": r.get("epsilon"),
                        "steps": r.get("steps"),
                        "wall_time_s": r.get("wall_time_s"),
                        "device": r.get("device"),
                        "finished": r["finished"],
                    }
                    for r in members
                ],
            }
        )
    return summary


def _median(runs: list[dict], field: str):
    values = [r[field] for r in runs if isinstance(r.get(field), (int, float))]
    return statistics.median(values) if values else None


def _eps_label(epsilon) -> str:
    return "–" if epsilon is None else _fmt_eps(epsilon)


def _fmt_time(seconds) -> str:
    if seconds is None:
        return "–"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def _fmt_value(value) -> str:
    if isinstance(value, list):
        return "mixed: " + ", ".join(_fmt_value(v) for v in value)
    if isinstance(value, int):
        return f"{value:,}"
    return "–" if value is None else str(value)


def _cell_text(cell: dict, prefix: str = "accuracy", count: str = "n") -> str:
    """median ± std (seeds) of the cell's `prefix`_median / _std, marked when a run stopped early."""
    if cell[f"{prefix}_median"] is None:
        return "–"
    std = "–" if cell[f"{prefix}_std"] is None else f"{100 * cell[f'{prefix}_std']:.2f}"
    mark = f" {EARLY_MARK}" if cell["stopped_early"] else ""
    return f"{100 * cell[f'{prefix}_median']:.2f} ± {std} ({cell[count]}){mark}"


def _header_lines(cells: list[dict], runs: list[dict], commands: list[dict]) -> list[str]:
    dataset, model = cells[0]["dataset"], cells[0]["model"]
    # train writes e.g. "cuda:0 (NVIDIA H100 80GB HBM3)"
    shown = ", ".join(
        sorted({str(d) for c in cells for d in (c["device"] if isinstance(c["device"], list) else [c["device"]])})
    )
    finished = sorted(r["finished"] for r in runs)
    dates = finished[0] if finished[0] == finished[-1] else f"{finished[0]} to {finished[-1]}"

    def setting(field: str) -> str:
        return _fmt_value(_common([c[field] for c in cells]))

    requested = (
        "" if all(c["requested_steps"] is None for c in cells) else f" of {setting('requested_steps')} requested"
    )
    lines = [
        f"dataset: {dataset} · model: {model} · delta: {setting('delta')} · device: {shown} · "
        f"runs finished: {dates} (UTC)",
        f"steps: {setting('steps')}{requested} · batch size: {setting('batch_size')} · aug mult: {setting('aug_mult')}",
    ]
    for c in commands:
        lines.append(
            f"command ({c.get('date', '?')}, commit {(c.get('git_commit') or 'unknown')[:10]}): `{c['command']}`"
        )
    if not commands:
        lines.append("command: not recorded")
    return lines


def _epsilon_table(groups: list[str], epsilons: list, by: dict, text: Callable[[dict], str]) -> list[str]:
    """Markdown rows (group x epsilon) of text(cell); "–" where a group has no run at that epsilon."""
    lines = [
        "| group | " + " | ".join(f"ε = {_eps_label(e)}" for e in epsilons) + " |",
        "|---|" + "---:|" * len(epsilons),
    ]
    for group in groups:
        label = BASELINE_LABEL if group.lower() == BASELINE else group
        cells = [by.get((group, e)) for e in epsilons]
        lines.append(f"| {label} | " + " | ".join("–" if c is None else text(c) for c in cells) + " |")
    return lines


def markdown(summary: list[dict], runs: list[dict], commands: list[dict]) -> str:
    out = ["# Accuracy benchmark", ""]
    for dataset, model in dict.fromkeys((c["dataset"], c["model"]) for c in summary):
        cells = [c for c in summary if (c["dataset"], c["model"]) == (dataset, model)]
        mine = [r for r in runs if (r["dataset"], r["model"]) == (dataset, model)]
        epsilons = sorted({c["epsilon"] for c in cells}, key=lambda e: (e is None, e))
        groups = sorted({c["group"] for c in cells}, key=_group_key)
        by = {(c["group"], c["epsilon"]): c for c in cells}
        out += [f"## {dataset}, {model}", ""]
        out += [line + "  " for line in _header_lines(cells, mine, commands)]
        out += ["", "Test accuracy (%), median ± std (number of seeds); std is the sample standard deviation.", ""]
        out.append(
            "| group | params | "
            + " | ".join(f"ε = {_eps_label(e)}" for e in epsilons)
            + " | wall time / run (median) |"
        )
        out.append("|---|---:|" + "---:|" * len(epsilons) + "---:|")
        for group in groups:
            row = [by.get((group, e)) for e in epsilons]
            present = [c for c in row if c is not None]
            label = BASELINE_LABEL if group.lower() == BASELINE else group
            wall = _median([r for r in mine if r["group"] == group], "wall_time_s")
            out.append(
                f"| {label} | {_fmt_value(_common([c['params'] for c in present]))} | "
                + " | ".join("–" if c is None else _cell_text(c) for c in row)
                + f" | {_fmt_time(wall)} |"
            )
        if any(c["shift_averaged_n"] for c in cells):
            shifts = _fmt_value(_common([c["test_shifts"] for c in cells if c["shift_averaged_n"]]))
            out += [
                "",
                f"Test accuracy (%) of the softmax averaged over each test image's shifted copies "
                f"(`--test-shifts {shifts}`: post-processing, no privacy cost), median ± std (number of seeds):",
                "",
            ]
            out += _epsilon_table(
                groups, epsilons, by, lambda c: _cell_text(c, "shift_averaged_accuracy", "shift_averaged_n")
            )
        out += ["", "Brier score (median over seeds):", ""]
        out += _epsilon_table(
            groups, epsilons, by, lambda c: "–" if c["brier_median"] is None else f"{c['brier_median']:.4f}"
        )
        early = [s for c in cells for s in c["stopped_early"]]
        if early:
            out += ["", f"{EARLY_MARK} includes runs that stopped before the requested steps:"]
            out += [
                f"- {s['run']}: {s['steps']} of {_fmt_value(s['requested_steps'])} steps ({s['reason']})" for s in early
            ]
        out.append("")
    return "\n".join(out)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((c["dataset"], c["model"]) for c in summary)) or [("", "")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (dataset, model) in zip(axes[0], panels):
        cells = [c for c in summary if (c["dataset"], c["model"]) == (dataset, model)]
        for group in sorted({c["group"] for c in cells}, key=_group_key):
            line = sorted((c for c in cells if c["group"] == group), key=lambda c: c["epsilon"])
            eps = [c["epsilon"] for c in line]
            med = [100 * c["accuracy_median"] for c in line]
            err = [
                [m - 100 * c["accuracy_min"] for m, c in zip(med, line)],
                [100 * c["accuracy_max"] - m for m, c in zip(med, line)],
            ]
            label = BASELINE_LABEL if group.lower() == BASELINE else group
            ax.errorbar(eps, med, yerr=err, marker="o", capsize=3, label=label)
        paper_table.epsilon_axis(ax, [c["epsilon"] for c in cells])
        ax.set_ylabel("test accuracy (%), median; bars: min-max over seeds")
        ax.set_title(f"{dataset}, {model}")
        ax.grid(alpha=0.3)
        if cells:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _commands(out: Path) -> list[dict]:
    """The invocations recorded in OUT, one entry per distinct command (a resumed grid repeats it)."""
    commands: list[dict] = []
    if (out / COMMANDS_FILE).exists():
        for line in (out / COMMANDS_FILE).read_text().splitlines():
            record = json.loads(line) if line.strip() else None
            if record and all(record["command"] != c["command"] for c in commands):
                commands.append(record)
    return commands


def _parts(run_dir: Path) -> list[dict]:
    try:
        lines = (run_dir / PARTS_FILE).read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def table_report(out: Path) -> dict:
    """A table folder's summary in the results page's paper_table schema, its Markdown and its figure."""
    import make_results_page

    definition = json.loads((out / TABLE_FILE).read_text())
    runs = {}
    for cell in definition["cells"]:
        for seed in cell["seeds"]:
            run_dir = out / paper_table.run_name(cell["name"], seed)
            result = _read_json(run_dir / "result.json")
            runs[run_dir.name] = {
                "result": result if isinstance(result, dict) and "test_accuracy" in result else None,
                "recorded": _read_json(run_dir / RUN_FILE),
                "parts": _parts(run_dir),
            }
    commands = _commands(out)
    summary = paper_table.summarize(definition, runs, commands[-1]["command"] if commands else None)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    figure = {"figure": {**summary["figure"], "path": "accuracy_vs_epsilon.png"}} if "figure" in summary else {}
    (out / "table.md").write_text("\n".join(make_results_page.render_section({**summary, **figure})))
    paper_table.plot(summary, out / "accuracy_vs_epsilon.png")
    counted = sum(len(r["accuracy"]) for r in summary["rows"])
    print(
        f"report: {counted} finished runs in {len(summary['rows'])} rows -> {out / 'summary.json'}, "
        f"{out / 'table.md'}, {out / 'accuracy_vs_epsilon.png'}",
        flush=True,
    )
    return summary


def report(out: Path, argv: list[str] | None = None) -> dict:
    if (out / TABLE_FILE).exists():
        return table_report(out)
    runs = load_runs(out)
    commands = _commands(out)
    summary = summarize(runs)
    document = {
        "generated": _now(),
        "report_command": _shown_command(argv) if argv is not None else None,
        "commands": commands,
        "runs": len(runs),
        "cells": summary,
    }
    (out / "summary.json").write_text(json.dumps(document, indent=2))
    (out / "table.md").write_text(
        markdown(summary, runs, commands) if summary else "# Accuracy benchmark\n\nno finished runs\n"
    )
    plot(summary, out / "accuracy_vs_epsilon.png")
    print(
        f"report: {len(runs)} runs in {len(summary)} cells -> {out / 'table.md'}, {out / 'summary.json'}, "
        f"{out / 'accuracy_vs_epsilon.png'}",
        flush=True,
    )
    return document


# --- entry point ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accuracy.py",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after `--` go verbatim to every `equiconvert train`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the grid (skipping finished runs), then report")
    run.add_argument("--dataset", required=True)
    run.add_argument("--data-dir", default=None, help="passed to train as --data-dir (omitted if not given)")
    run.add_argument("--model", default="equiconvert:resnet9")
    run.add_argument("--groups", required=True, help="comma-separated, 'none' = the unconverted baseline")
    run.add_argument("--epsilons", required=True, help="comma-separated target epsilons")
    run.add_argument("--seeds", default="0,1,2")
    run.add_argument("--out", required=True, help="folder of the grid: one sub-folder per run, plus the report")
    run.add_argument("--devices", default="cpu", help="comma-separated train --device values (default cpu)")
    run.add_argument("--jobs-per-device", type=int, default=1)
    run.add_argument(
        "--continue-stopped",
        action="store_true",
        help="resume runs that train's --time-limit stopped (result.json + checkpoint.pt) instead of skipping them",
    )
    rep = sub.add_parser("report", help="summarize OUT/*/result.json into summary.json, table.md and a plot")
    rep.add_argument("--out", required=True)
    _add_table_parser(sub)
    return parser


def _add_table_parser(sub: Any) -> None:
    tab = sub.add_parser(
        "table",
        help="train a recipe table's cells (skipping finished runs, resuming stopped ones), then report it "
        "in the results page's paper_table format",
    )
    tab.add_argument("table", help="a shipped table's name (equiconvert/recipes/tables/NAME.toml) or a TOML file")
    tab.add_argument("--out", required=True, help="folder of the table: one sub-folder per run, plus the report")
    tab.add_argument("--data-dir", default=None, help="passed to train as --data-dir (omitted if not given)")
    tab.add_argument("--cells", default=None, help="comma-separated cell names to train (default: every cell)")
    tab.add_argument("--nproc-per-node", type=int, default=1, help="processes (GPUs) per run (default 1)")
    tab.add_argument("--device", default=None, help="train --device (default: train's own, cuda if available)")
    tab.add_argument(
        "--gpus",
        default=None,
        help="comma-separated card indices: runs side by side, each on --nproc-per-node of them "
        "(CUDA_VISIBLE_DEVICES); default: one run at a time on the first --nproc-per-node visible cards",
    )
    tab.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="budget of this invocation: each run trains until it is spent (less --startup-margin) and stops "
        "with a checkpoint; the same command continues it",
    )
    tab.add_argument(
        "--startup-margin",
        type=float,
        default=STARTUP_MARGIN_S,
        metavar="SECONDS",
        help=f"of the budget, kept per run for start-up, final evaluation and saving (default {STARTUP_MARGIN_S:g})",
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = _parser().parse_args(ours)
    if args.command == "report":
        if extra:
            raise SystemExit("error: report takes no train arguments")
        report(Path(args.out), argv=argv)
        return 0
    if args.command == "table":
        return run_table(args, extra, argv)
    return run_grid(args, extra, argv)


if __name__ == "__main__":
    sys.exit(main())
