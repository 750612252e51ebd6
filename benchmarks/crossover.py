"""Step times of several checkouts of equiconvert side by side: a crossover over the GPUs of one host.

Every round runs each checkout's own benchmarks/throughput.py once with the same arguments, as many at a time as
there are GPUs, and moves each checkout to the next GPU from round to round, so that a difference between cards
cancels out instead of reading as a difference between versions. A checkout is a folder holding equiconvert/ and
benchmarks/, e.g. made with `git worktree add DIR COMMIT` or `git archive COMMIT equiconvert benchmarks | tar -x -C
DIR`; throughput.py imports the equiconvert/ beside it. The first checkout is the baseline of the ratios.

Usage: python benchmarks/crossover.py --checkout before=DIR1 --checkout after=DIR2 --rounds 4 --gpus 0,1 \\
    --out crossover.json -- --device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark \\
    --warmup 3 --iters 10 --methods nonprivate,bookkeeping:fastest --precision bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_output import emit  # noqa: E402


@dataclass(frozen=True)
class Run:
    """One throughput.py run of one checkout in one round, on one GPU (None: no GPU pinned)."""

    checkout: str
    round: int
    gpu: str | None


def parse_checkout(text: str) -> tuple[str, Path]:
    """NAME=DIR, checked to hold equiconvert/ and benchmarks/throughput.py before anything runs."""
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"--checkout {text!r}: expected NAME=DIR")
    path = Path(folder).resolve()
    missing = [p for p in ("equiconvert/__init__.py", "benchmarks/throughput.py") if not (path / p).is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"--checkout {text!r}: {path} has no {', '.join(missing)}")
    return name, path


def schedule(checkouts: list[str], gpus: list[str | None], rounds: int) -> list[list[Run]]:
    """Waves of runs, each wave at once with one run per GPU; in round r checkout i runs on GPU (i + r) mod G."""
    waves = []
    for r in range(rounds):
        for start in range(0, len(checkouts), len(gpus)):
            names = checkouts[start : start + len(gpus)]
            waves.append([Run(n, r, gpus[(start + i + r) % len(gpus)]) for i, n in enumerate(names)])
    return waves


def run_one(run: Run, folder: Path, throughput_args: list[str], timeout: float) -> dict[str, Any]:
    """throughput.py of `folder` on the run's GPU; its JSON report, refused unless it timed that folder's code."""
    env = dict(os.environ)
    if run.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = run.gpu
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "throughput.json"
        command = [sys.executable, str(folder / "benchmarks" / "throughput.py"), *throughput_args, "--out", str(out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"checkout {run.checkout!r}, round {run.round}: throughput.py failed:\n{done.stderr}")
        report = json.loads(out.read_text())
    imported = Path(report.get("equiconvert", "")).resolve()
    if imported != (folder / "equiconvert").resolve():
        raise RuntimeError(
            f"checkout {run.checkout!r}: throughput.py imported equiconvert from {imported}, not from {folder}; "
            "a checkout must hold its own benchmarks/ beside its equiconvert/"
        )
    return report


def summarize(records: list[dict[str, Any]], checkouts: list[str]) -> dict[str, dict[str, Any]]:
    """Per checkout and method: every run's ms per step, their median, peak memory and the median's ratio to the
    first checkout's."""
    summary: dict[str, dict[str, Any]] = {}
    for name in checkouts:
        mine = [r for r in records if r["checkout"] == name]
        methods = dict.fromkeys(m for r in mine for m in r["results"])
        summary[name] = {
            method: {
                "ms_per_step": [r["results"][method]["ms_per_step"] for r in mine],
                "median_ms_per_step": statistics.median(r["results"][method]["ms_per_step"] for r in mine),
                "peak_memory_gib": max(r["results"][method].get("peak_memory_gib") or 0.0 for r in mine),
            }
            for method in methods
        }
    base = summary[checkouts[0]]
    for per_method in summary.values():
        for method, entry in per_method.items():
            if method in base:
                entry["vs_first"] = round(entry["median_ms_per_step"] / base[method]["median_ms_per_step"], 4)
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, throughput_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=parse_checkout, action="append", required=True, help="NAME=DIR, repeated")
    parser.add_argument("--rounds", type=int, default=2, help="every checkout runs once per round")
    parser.add_argument("--gpus", default="", help="comma-separated CUDA devices run at once; empty: one at a time")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one throughput.py run may take")
    parser.add_argument("--out", default=None, help="JSON report")
    args = parser.parse_args(own)
    names = [name for name, _ in args.checkout]
    if len(set(names)) != len(names):
        parser.error(f"--checkout: names must differ, got {names}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    if "--out" in throughput_args:
        parser.error("the throughput.py arguments after -- must not set --out: each run's report is collected here")
    folders = dict(args.checkout)
    gpus: list[str | None] = [g.strip() for g in args.gpus.split(",") if g.strip()] or [None]
    records = []
    for wave in schedule(names, gpus, args.rounds):
        with ThreadPoolExecutor(len(wave)) as pool:
            reports = list(pool.map(lambda r: run_one(r, folders[r.checkout], throughput_args, args.timeout), wave))
        for run, report in zip(wave, reports):
            records.append({"checkout": run.checkout, "round": run.round, "gpu": run.gpu, **report})
            print(
                f"round {run.round} {run.checkout} on GPU {run.gpu}: "
                + ", ".join(f"{m} {v['ms_per_step']:.2f} ms" for m, v in report["results"].items()),
                flush=True,
            )
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/crossover.py", *argv]),
        "devices": sorted({r.get("device", "?") for r in records}),
        "checkouts": {name: str(folder) for name, folder in folders.items()},
        "summary": summarize(records, names),
        "runs": [{k: r[k] for k in ("checkout", "round", "gpu", "results")} for r in records],
    }
    print(emit(result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
