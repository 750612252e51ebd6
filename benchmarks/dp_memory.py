"""Peak memory of one DP-SGD step per engine: equiconvert's book-keeping and ghost clipping against Opacus'.

The model is torchvision's resnet18 (10 classes) converted to a group (C4 by default) by make_equivariant, one
batch of B images (32x32) with K views. Each engine runs in a fresh subprocess: it builds the model, runs one step
(the warm-up: first-step probes, lazy allocations), then measures a second step. The engine's memory is the peak
during that step less the memory held once the model and the batch were built, before the engine was: what the
engine holds between steps (per-example gradients kept, optimizer state) and what the step allocates.

- CUDA: torch.cuda.max_memory_allocated over that step, less torch.cuda.memory_allocated before the engine;
- CPU: the process's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs before the step) less
  its resident set before the engine, with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_) so that every large
  tensor is mapped on allocation and returned on free. Where clear_refs cannot be written, ru_maxrss over the whole
  process, warm-up included, is used instead (`measured_by` says which).

Engines: `bookkeeping` (DPTrainer, per_sample_method="bookkeeping": every per-example gradient at once), `ghost`
(DPTrainer, per_sample_method="ghost": per-layer norms, then the clipped sum, from one recorded backward), `make_private_ghost`
(make_private(..., grad_sample_mode="ghost") under the user's loop: per-layer norms and clipped sums from its one
backward), `opacus_hooks` (Opacus'
GradSampleModule with equiconvert's registered samplers) and `opacus_ghost` (Opacus' ghost clipping), as
dp_engine_adapters.py builds them; the subprocesses run side by side (memory is per process; the seconds are
then those of a shared machine). JSON: per engine its memory (`engine_peak_mib`) and the whole process's peak
(MiB), seconds per step, and its memory over each Opacus engine's (`ratio_to_opacus_hooks`,
`ratio_to_opacus_ghost`), or `not_run` with the reason. `--tiny`: a small converted CNN, B = 4, 16x16 (a smoke run for tests/benchmarks/test_dp_memory.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from subprocess import PIPE

import torch
from torch import nn

BENCHMARKS = Path(__file__).resolve().parent
for _path in (BENCHMARKS.parent, BENCHMARKS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from dp_engine_adapters import Case, NotRun, dptrainer, make_private, opacus_ghost, opacus_hooks  # noqa: E402

import equiconvert  # noqa: E402

ENGINES = {
    "bookkeeping": partial(dptrainer, method="bookkeeping"),
    "ghost": partial(dptrainer, method="ghost"),
    "make_private_ghost": partial(make_private, grad_sample_mode="ghost"),
    "opacus_hooks": opacus_hooks,
    "opacus_ghost": opacus_ghost,
}
BASELINES = ("opacus_hooks", "opacus_ghost")
MIB = 2**20
MMAP_THRESHOLD = "65536"  # bytes: fixed, so glibc maps (and on free unmaps) every large tensor


class TinyNet(nn.Module):
    """Three convs and a linear head: the --tiny model, converted like resnet18."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.GroupNorm(4, 16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def build_model(tiny: bool, group: str) -> nn.Module:
    """resnet18 (num_classes=10) or TinyNet, converted to `group`, in train mode."""
    if tiny:
        plain: nn.Module = TinyNet()
    else:
        from torchvision.models import resnet18

        plain = resnet18(num_classes=10)
    return equiconvert.make_equivariant(plain, group).train()


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_high_water_mark() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def measure(engine: str, args: argparse.Namespace) -> dict:
    """One engine's step peak, in this process (the child of `main`)."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = build_model(args.tiny, args.group).to(device)
    generator = torch.Generator().manual_seed(args.seed)
    images = torch.rand(args.batch, 3, args.size, args.size, generator=generator).to(device)
    labels = (torch.arange(args.batch) % 10).to(device)
    case = Case(f"resnet18 {args.group}", model, images, labels, args.aug_mult, args.clip, args.noise, 0.1, device)
    gc.collect()
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else _status_kib("VmRSS") * 1024
    try:
        runner = ENGINES[engine](case, "fp32")
        runner.step()  # warm-up: probes and first-step allocations
    except NotRun as reason:
        return {"not_run": str(reason)}
    del case
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset = _reset_high_water_mark()
    start = time.perf_counter()
    runner.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak, measured_by = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
    elif reset:
        peak, measured_by = _status_kib("VmHWM") * 1024, "VmHWM after /proc/self/clear_refs (RSS)"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        measured_by = "ru_maxrss over the whole process, warm-up included (clear_refs not writable)"
    seconds = time.perf_counter() - start
    return {
        "engine_peak_mib": round((peak - before) / MIB, 1),
        "process_peak_mib": round(peak / MIB, 1),
        "seconds": round(seconds, 2),
        "measured_by": measured_by,
    }


def in_subprocesses(engines: list[str], argv: list[str]) -> dict[str, dict]:
    """Each engine's record from its own fresh process (all started at once; each prints its record, writes nothing)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    children = {
        engine: subprocess.Popen(
            [sys.executable, __file__, *argv, "--child", engine], stdout=PIPE, stderr=PIPE, text=True, env=env
        )
        for engine in engines
    }
    results = {}
    for engine, child in children.items():
        out, err = child.communicate()
        if child.returncode != 0:
            results[engine] = {"error": err.strip().splitlines()[-1] if err.strip() else f"exit {child.returncode}"}
        else:
            results[engine] = json.loads(out.strip().splitlines()[-1])
    return results


def with_ratios(results: dict[str, dict]) -> dict[str, dict]:
    """Each engine's memory over each Opacus engine's that ran."""
    for record in results.values():
        for baseline in BASELINES:
            base = results.get(baseline, {}).get("engine_peak_mib")
            if "engine_peak_mib" in record and base:
                record[f"ratio_to_{baseline}"] = round(record["engine_peak_mib"] / base, 3)
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--group", default="C4")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--aug-mult", type=int, default=1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--noise", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a small converted CNN, B = 4, 16x16 (smoke run)")
    parser.add_argument("--out", default=None, help="JSON file (default: print only)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.tiny:
        args.batch, args.size = min(args.batch, 4), 16
    if args.child is not None:
        print(json.dumps(measure(args.child, args)))
        return 0
    engines = args.engines.split(",")
    if unknown := [e for e in engines if e not in ENGINES]:
        raise SystemExit(f"--engines: unknown {unknown}; choose from {', '.join(ENGINES)}")
    results = with_ratios(in_subprocesses(engines, argv))
    report = {
        "model": ("TinyNet" if args.tiny else "torchvision resnet18 (num_classes=10)") + f" -> {args.group}",
        "batch": args.batch,
        "aug_mult": args.aug_mult,
        "image_size": args.size,
        "device": args.device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/dp_memory.py " + " ".join(argv),
        "engines": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
