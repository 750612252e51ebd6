"""Where a DP step's time goes: torch.profiler over book-keeping and non-private steps of the same model and batch.

Complements throughput.py (which times whole steps): for each method, the device time of every kernel (summed
over the profiled steps, per step) and of the step's phases, which equiconvert marks with `record_function`
ranges: `equiconvert/forward`, `equiconvert/backward` (activation gradients only; on CUDA the autograd engine
launches its kernels from its own thread, so they land in "other"), `equiconvert/per_example/<layer type>` (each
layer's per-example gradients), `equiconvert/clip_and_sum`; "other" is every kernel outside those ranges.
Also the host's share: every ATen operator the step dispatches (one unprofiled step, counted by a
TorchDispatchMode), by the innermost equiconvert function that called it. A step whose CPU time exceeds its
kernels' time is bound by the host, and these counts say where its launches come from (Triton kernels are not
ATen operators and are not counted; on CPU the norms run as plain torch ops, so their counts are higher there).
Writes JSON; prints the tables.
Usage: python benchmarks/profile_step.py --device cuda --model paper --batch 512 --aug-mult 4 --precision bf16
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import build_model, make_equiconvert_step, make_nonprivate_step  # noqa: E402
from wrn import wrn  # noqa: E402

import equiconvert  # noqa: E402
from equiconvert.training.augment import augment_views  # noqa: E402
from equiconvert.privacy.backends import PRECISIONS  # noqa: E402

WRN = "wrn16_4"
PACKAGE = Path(equiconvert.__file__).resolve().parent
_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})


def _device_ms(event) -> float:
    return getattr(event, "device_time_total", 0.0) / 1e3


def phase_times(events, steps: int) -> dict[str, dict[str, float]]:
    """Each equiconvert range's device time: the kernels launched inside its CPU span (not the span its kernels
    cover on the device, which also counts the gaps between them), and its CPU time, in ms per step."""
    phases: dict[str, dict[str, float]] = {}
    for e in events:
        if e.name.startswith("equiconvert/") and e.device_type == torch.autograd.DeviceType.CPU:
            phase = phases.setdefault(e.name, {"device_ms": 0.0, "cpu_ms": 0.0})
            phase["device_ms"] += _device_ms(e) / steps
            phase["cpu_ms"] += e.cpu_time_total / 1e3 / steps
    return phases


class _OperatorCounter(TorchDispatchMode):
    """Counts each dispatched ATen operator by the innermost frame of an equiconvert/ file above it."""

    def __init__(self) -> None:
        super().__init__()
        self.by_source: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_source[_equiconvert_caller()] += 1
        return func(*args, **(kwargs or {}))


def _equiconvert_caller() -> str:
    """'path/in/package.py:function' of the innermost function in the equiconvert package, or 'outside equiconvert'.

    Comprehensions count as the function that holds them (Python 3.12 inlines them, earlier versions do not).
    """
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if frame.name not in _COMPREHENSIONS and path.is_relative_to(PACKAGE):
            return f"{path.relative_to(PACKAGE).as_posix()}:{frame.name}"
    return "outside equiconvert"


def count_host_operators(step, model, views, labels, top: int) -> dict:
    """ATen operators dispatched by one step (after the profiled ones): the total and the `top` sources."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with _OperatorCounter() as counter:
        step(model, optimizer, views, labels)
    rows = [{"source": source, "operators": n} for source, n in counter.by_source.most_common(top)]
    return {"total": sum(counter.by_source.values()), "by_source": rows}


def phase_kernels(events, steps: int, top: int) -> dict[str, list[dict]]:
    """Each equiconvert range's `top` kernels by device time (the kernels its operators and theirs launched), in ms
    per step: which kernels a phase's time is made of (the copies inside the per-example gradients, say)."""
    by_phase: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    calls: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for e in events:
        if not (e.name.startswith("equiconvert/") and e.device_type == torch.autograd.DeviceType.CPU):
            continue
        pending = [e]
        while pending:
            child = pending.pop()
            pending.extend(child.cpu_children)
            for kernel in child.kernels:
                by_phase[e.name][kernel.name[:120]] += kernel.duration / 1e3 / steps
                calls[e.name][kernel.name[:120]] += 1
    return {
        phase: [{"name": n, "device_ms": ms, "calls": calls[phase][n] // steps} for n, ms in kernels.most_common(top)]
        for phase, kernels in by_phase.items()
    }


def profile_method(step, model, views, labels, device: torch.device, steps: int, top: int) -> dict:
    """Kernels and equiconvert phases of `steps` profiled steps (after two warm-up steps), in ms per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):
        step(model, optimizer, views, labels)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(model, optimizer, views, labels)
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    ranges = [e for e in events if e.key.startswith("equiconvert/")]
    phases = phase_times(prof.events(), steps)
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e not in ranges),
        key=_device_ms,
        reverse=True,
    )
    total = sum(_device_ms(e) for e in kernels) / steps
    if device.type == "cuda":  # ranges nest nowhere, so the kernels outside them are the rest
        phases["other"] = {"device_ms": total - sum(p["device_ms"] for p in phases.values() if p["device_ms"] > 0)}
    kernel_rows = [
        {"name": e.key[:160], "device_ms": _device_ms(e) / steps, "calls": e.count // steps} for e in kernels[:top]
    ]
    return {
        "phases": phases,
        "kernel_device_ms_total": total,
        "kernels": kernel_rows,
        "phase_kernels": phase_kernels(prof.events(), steps, top),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--model",
        choices=("resnet9", "paper", WRN),
        default="paper",
        help=f"{WRN}: De et al.'s plain WRN-16-4 of benchmarks/dp_engines.py (--group unused)",
    )
    parser.add_argument("--group", default="D4")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--aug-mult", type=int, default=4)
    parser.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32")
    parser.add_argument("--filter-gradients", default="auto", help="book-keeping's conv filter-gradient kernel")
    parser.add_argument("--cudnn-benchmark", action="store_true")
    parser.add_argument(
        "--channels-last", action="store_true", help="the model and the views in channels-last memory format"
    )
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per method")
    parser.add_argument("--top", type=int, default=25, help="kernels listed per method")
    parser.add_argument("--out", default="benchmarks/results/profile_step.json")
    args = parser.parse_args(argv)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    device = torch.device(args.device)
    autocast_dtype = PRECISIONS[args.precision]
    torch.manual_seed(0)
    images = torch.randn(args.batch, 3, 32, 32, device=device)
    views = augment_views(images, args.aug_mult, torch.Generator(device=device).manual_seed(0))
    labels = torch.randint(0, 10, (args.batch,), device=device)
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    if args.channels_last:  # (B, K, C, H, W): each view channels-last
        views = views.flatten(0, 1).contiguous(memory_format=layout).unflatten(0, views.shape[:2])
    steps = {
        "nonprivate": make_nonprivate_step(autocast_dtype),
        "bookkeeping": make_equiconvert_step(args.batch, "bookkeeping", autocast_dtype, args.filter_gradients),
    }
    results = {}
    for method, step in steps.items():
        model = (
            wrn(16, 4).to(device).train()
            if args.model == WRN
            else build_model(args.model, (16, 32, 64), 1.5, device, args.group)
        )
        model = model.to(memory_format=layout)
        results[method] = profile_method(step, model, views, labels, device, args.steps, args.top)
        results[method]["host_operators"] = count_host_operators(step, model, views, labels, args.top)
        print(f"== {method}: kernels {results[method]['kernel_device_ms_total']:.2f} ms/step")
        print(f"   {results[method]['host_operators']['total']} ATen operators dispatched per step")
        for name, phase in results[method]["phases"].items():
            print(f"   {phase['device_ms']:8.2f} ms device {phase.get('cpu_ms', float('nan')):8.2f} ms cpu  {name}")
        for row in results[method]["kernels"]:
            print(f"   {row['device_ms']:8.2f} ms {row['calls']:4d}x  {row['name'][:110]}")
        for phase, rows in results[method]["phase_kernels"].items():
            print(f"   -- {phase}")
            for row in rows[:8]:
                print(f"      {row['device_ms']:8.2f} ms {row['calls']:4d}x  {row['name'][:100]}")
        for row in results[method]["host_operators"]["by_source"]:
            print(f"   {row['operators']:8d} ops      {row['source']}")
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/profile_step.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "aug_mult": args.aug_mult,
        "precision": args.precision,
        "filter_gradients": args.filter_gradients,
        "cudnn_benchmark": args.cudnn_benchmark,
        "channels_last": args.channels_last,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
