"""Where a `train` step's time goes around the DP step: torch.profiler over whole logical steps of DPTrainer.

profile_step.py profiles the step of one fixed physical batch; a `train` step also draws a Poisson batch, gathers
and augments each physical chunk, adds the noise, updates the weights and the EMA. This profiles `--steps` logical
steps (after `--warmup` unprofiled ones) of DPTrainer on a real data set with the paper's D4 model at the
epsilon-8 recipe's batch, and reports per logical step: the wall time, the kernels' device time (a step whose
wall time exceeds it waits for the host) and each range equiconvert marks, the trainer's `equiconvert/sample`,
`equiconvert/gather_and_augment`, `equiconvert/noise` and `equiconvert/update_and_ema` beside the step's own
(profile_step.py). The noise multiplier is fixed (no calibration) and nothing is written but the JSON: a run for
timing only. Prints the table.
Usage: python benchmarks/profile_train.py --device cuda --data-dir DIR --physical-batch-size 512 --precision bf16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_step import _device_ms, phase_times  # noqa: E402
from throughput import build_model  # noqa: E402

from equiconvert.convert import fuse_norm_pools  # noqa: E402
from equiconvert.data import load_dataset  # noqa: E402
from equiconvert.privacy.backends import PRECISIONS  # noqa: E402
from equiconvert.training import DPConfig, DPTrainer  # noqa: E402
from equiconvert.training.callbacks import Callback  # noqa: E402

NOISE_MULTIPLIER = 4.98  # the epsilon-8 recipe's calibrated sigma; timing does not depend on it


class _ProfiledSteps(Callback):
    """Advances the profiler's schedule at each logical step and times the profiled ones (the device drained)."""

    def __init__(self, profiler: profile, warmup: int, steps: int, device: torch.device) -> None:
        self.profiler, self.first, self.last, self.device = profiler, warmup, warmup + steps, device
        self.started = self.ended = 0.0

    def _drained_clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def on_step_end(self, trainer: Any, record: dict[str, Any]) -> None:
        if record["step"] == self.first:
            self.started = self._drained_clock()
        elif record["step"] == self.last:
            self.ended = self._drained_clock()
        self.profiler.step()


def profile_train(args: argparse.Namespace) -> dict[str, Any]:
    """Per logical step: wall time, kernel time and the marked ranges, over the profiled steps."""
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    torch.manual_seed(0)
    data = load_dataset(args.dataset, args.data_dir, split="train", **_dataset_options(args))
    model = build_model("paper", (), 0.0, device, args.group, num_classes=len(data.classes))
    fused = fuse_norm_pools(model) if args.fuse_norm_pools else 0
    config = DPConfig(
        target_epsilon=None,
        noise_multiplier=NOISE_MULTIPLIER,
        batch_size=args.batch_size,
        aug_mult=args.aug_mult,
        physical_batch_size=args.physical_batch_size,
        physical_batch_multiple=args.physical_batch_multiple,
        precision=args.precision,
        steps=args.warmup + args.steps,
        checkpoint_every=None,
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # the schedule's step count is the callback's: wait, warm up one step, record `steps`
    plan = schedule(wait=args.warmup - 1, warmup=1, active=args.steps, repeat=1)
    with profile(activities=activities, schedule=plan) as profiler:
        timer = _ProfiledSteps(profiler, args.warmup, args.steps, device)
        trainer = DPTrainer(model, device=device, progress=False, loggers=(), callbacks=[timer], config=config)
        trainer.fit((data.images, data.labels))
    events = profiler.events()
    phases = phase_times(events, args.steps)
    return {
        "wall_ms_per_step": 1000 * (timer.ended - timer.started) / args.steps,
        "kernel_device_ms_per_step": kernel_ms_per_step(events, args.steps),
        "samples_per_s": args.batch_size * args.aug_mult * args.steps / (timer.ended - timer.started),
        "fused_norm_pools": fused,
        "phases": dict(sorted(phases.items(), key=lambda item: -item[1]["cpu_ms"])),
    }


def kernel_ms_per_step(events: list[Any], steps: int) -> float:
    """The device time of the kernels, per step: the device spans of the marked ranges and of the schedule's
    ProfilerStep#N cover kernels and are left out, or every kernel would count twice."""
    spans = ("equiconvert/", "ProfilerStep")
    device = torch.autograd.DeviceType.CUDA
    return sum(_device_ms(e) for e in events if e.device_type == device and not e.name.startswith(spans)) / steps


def _dataset_options(args: argparse.Namespace) -> dict[str, Any]:
    """The synthetic data set's size (the CPU test's); a real one takes none."""
    return {"num_examples": args.synthetic_examples} if args.dataset == "synthetic" else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--synthetic-examples", type=int, default=512, help="--dataset synthetic: its size")
    parser.add_argument("--group", default="D4")
    parser.add_argument("--batch-size", type=int, default=8192, help="expected logical batch")
    parser.add_argument("--aug-mult", type=int, default=4)
    parser.add_argument("--physical-batch-size", type=int, default=512)
    parser.add_argument("--physical-batch-multiple", type=int, default=1)
    parser.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16")
    parser.add_argument("--fuse-norm-pools", action="store_true")
    parser.add_argument("--cudnn-benchmark", action="store_true")
    parser.add_argument("--warmup", type=int, default=5, help="unprofiled logical steps first (at least 1)")
    parser.add_argument("--steps", type=int, default=3, help="profiled logical steps")
    parser.add_argument("--out", default="benchmarks/results/profile_train.json")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps: at least 1 each")
    result = profile_train(args)
    report = {
        "benchmark": "profile_train",
        "date": datetime.now(timezone.utc).date().isoformat(),
        **{key: value for key, value in vars(args).items() if key != "out"},
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(torch.device(args.device)),
        **result,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{report['device']}: {result['wall_ms_per_step']:.1f} ms per logical step, "
        f"kernels {result['kernel_device_ms_per_step']:.1f} ms, {result['samples_per_s']:.0f} augmented samples/s"
    )
    for name, phase in result["phases"].items():
        print(f"   {phase['device_ms']:9.2f} ms device {phase['cpu_ms']:9.2f} ms cpu  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
