"""Samples/s of `equiconvert train` on 1 GPU and on N GPUs of one host (data-parallel DP-SGD).

Each configuration is a fresh, short run (no periodic checkpoints, no resume) of the same command, the paper's D4
Equivariant-ResNet9 on CIFAR-10 at the paper's batch (8192 x 4 views) unless told otherwise; N GPUs run it
with `train --nproc-per-node N`. Throughput is steady-state: augmented samples from the first step at or
after `--warmup` whose record waited for the device to the last step, over the time between them (start-up
and the final evaluation excluded; both are in wall_time_s and samples_per_s_with_startup_and_evaluation).
Samples are counted at the expected batch size, expected_samples_per_step = aug_mult x batch_size per step:
the actual Poisson batch sizes are secret (with the timings they would give away the sampling), so the runs
log no non-private statistics. The step times it reads are logged only on request (dp.log_step_times): they
grow with the secret batch sizes and are outside the privacy guarantee, so a benchmark's run is for timing,
not for release. Prints one JSON object.

Usage (a 4-GPU host, CIFAR-10 extracted from shared/data/cifar10-jpeg.tar.xz into /tmp/cifar):
    python benchmarks/distributed_smoke.py --data-dir /tmp/cifar/cifar10 --gpus 1,4 --steps 80
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PAPER_RUN = [
    "--model",
    "equiconvert:equivariant_resnet9",
    "--group",
    "D4",
    "--epsilon",
    "8",
    "--delta",
    "1e-5",
    "--lr",
    "2",
    "--max-grad-norm",
    "2",
    "--set",
    "schedule.ema_decay=0.999",
]


def steady_throughput(records: list[dict[str, Any]], samples_per_step: float, warmup: int) -> dict[str, float]:
    """Expected samples/s between the first step record from step `warmup` on that carries epsilon and the last.

    Only those records are written after the device has finished their step; the ones between hold the
    time their step was queued. `samples_per_step`: the expected augmented samples of one step.
    """
    synced = [r for r in records if "lr" in r and "epsilon" in r and "time_s" in r and r["step"] >= warmup]
    if len(synced) < 2:
        raise ValueError(f"need two logged steps with epsilon after step {warmup}; raise --steps")
    first, last = synced[0], synced[-1]
    steps = last["step"] - first["step"]
    seconds = last["time_s"] - first["time_s"]
    return {
        "measured_steps": steps,
        "seconds": seconds,
        "samples_per_s": samples_per_step * steps / seconds,
        "ms_per_step": 1000 * seconds / steps,
    }


def visible_devices(gpus: int, environ: dict[str, str]) -> str:
    """CUDA_VISIBLE_DEVICES for a run on `gpus` GPUs: the first of the caller's own list (so that two benchmarks
    can share a host, each on its cards), or 0..gpus-1 without one."""
    given = [d.strip() for d in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not given:
        return ",".join(str(i) for i in range(gpus))
    if len(given) < gpus:
        raise ValueError(f"--gpus {gpus}: CUDA_VISIBLE_DEVICES={','.join(given)} names only {len(given)}")
    return ",".join(given[:gpus])


def run(gpus: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One fresh `train` run on `gpus` GPUs; its throughput and timings."""
    command = [sys.executable, "-m", "equiconvert", "train"]
    if gpus > 1:
        command += ["--nproc-per-node", str(gpus)]
    command += [
        *PAPER_RUN,
        "--dataset",
        args.dataset,
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--aug-mult",
        str(args.aug_mult),
        "--physical-batch-size",
        str(args.physical_batch_size),
        "--set",
        f"dp.precision={args.precision}",
        "--set",
        "schedule.checkpoint_every=0",
        "--set",
        "dp.log_step_times=true",
        "--device",
        args.device,
        "--set",
        "run.progress=false",
        "--out",
        str(out),
        *args.extra,
    ]
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus, env)
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    result = json.loads((out / "result.json").read_text())
    expected = result["aug_mult"] * result["batch_size"]  # the run's own settings, --extra included
    return {
        "gpus": gpus,
        "expected_samples_per_step": expected,
        **steady_throughput(records, expected, args.warmup),
        "wall_time_s": wall,
        "samples_per_s_with_startup_and_evaluation": expected * result["steps"] / wall,
        "train_time_s": result["train_time_s"],
        "test_accuracy": result["test_accuracy"],
        "device": result["device"],
        "world_size": result["world_size"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="1,4", help="comma-separated process counts, e.g. 1,2,4")
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the throughput (start-up)")
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--aug-mult", type=int, default=4)
    parser.add_argument("--physical-batch-size", type=int, default=512)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="further `train` options (last on the line), e.g. --extra --model ... --widths 4,8,8",
    )
    args = parser.parse_args(argv)
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for gpus in (int(g) for g in args.gpus.split(",")):
            runs.append(run(gpus, args, Path(folder) / f"gpus{gpus}"))
    report: dict[str, Any] = {
        "batch_size": args.batch_size,
        "aug_mult": args.aug_mult,
        "steps": args.steps,
        "precision": args.precision,
        "runs": runs,
    }
    base = next((r for r in runs if r["gpus"] == 1), None)
    if base is not None:
        report["scaling_efficiency"] = {
            str(r["gpus"]): r["samples_per_s"] / (r["gpus"] * base["samples_per_s"]) for r in runs
        }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
