"""The same DP-SGD step in each engine, side by side on one device: ms per step, samples/s, peak memory, and the time
relative to that engine's own non-private step.

Same model (initialised from one seed), the same B images with the same K views (fixed_views: the image, then rolled
and flipped copies), labels, clip C, noise multiplier sigma and lr for every engine; the engines and what each one
clips are described in dp_engine_adapters.py and benchmarks/README.md. Before timing, each engine's noise-free step on
a small batch is compared with a per-example loop (fidelity_step.naive_step) of the same clipping unit, so the table
times the step it claims to. Engines that cannot run here are listed with the reason.
Usage: python benchmarks/dp_engines.py --batch 512 --aug-mult 4 [--fastdp DIR] [--released DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dp_engine_adapters import ENGINES, EXAMPLE_MEAN, EXAMPLE_SUM, NONPRIVATE, VIEW, Case, NotRun, Runner  # noqa: E402
from fidelity_model import relative_difference  # noqa: E402
from fidelity_step import naive_step, tiny_model  # noqa: E402
from throughput import MAX_GRAD_NORM, NOISE, build_model  # noqa: E402
from wrn import wrn  # noqa: E402

from equiconvert.privacy.backends import PRECISIONS  # noqa: E402
from equiconvert.privacy.filter_gradients import fastest_choices  # noqa: E402

# model name -> (full-size builder, --tiny builder, description); each builds on the CPU from the current seed
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module], str]] = {
    "paper": (
        lambda: build_model("paper", (), 1.5, torch.device("cpu")),
        tiny_model,
        "Hölzl et al.'s D4 Equivariant-ResNet9 (--tiny: a C4 one of layout 8, 8, 8)",
    ),
    "wrn16_4": (
        lambda: wrn(16, 4),
        lambda: wrn(10, 1),
        "De et al.'s WRN-16-4, GroupNorm, plain convs (--tiny: WRN-10-1)",
    ),
}
TINY = {"batch": 2, "aug_mult": 2, "image_size": 16, "warmup": 1, "iters": 1, "check_batch": 2}

# how the per-example loop that checks an engine reduces each example's K view gradients ("view": no reduction,
# each view its own example)
REFERENCES = {EXAMPLE_MEAN: "mean", EXAMPLE_SUM: "sum", VIEW: "view"}


def card(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or "cpu"


def make_case(args, model_name: str, batch: int, device: torch.device) -> Case:
    torch.manual_seed(0)
    full, tiny, _ = MODELS[model_name]
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    model = (tiny if args.tiny else full)().to(device, memory_format=layout).train()
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, args.image_size, args.image_size, generator=generator).to(device)
    images = images.contiguous(memory_format=layout)
    labels = (torch.arange(batch) % 10).to(device)
    return Case(
        model_name,
        model,
        images,
        labels,
        args.aug_mult,
        args.clip,
        args.noise,
        args.lr,
        device,
        args.fastdp,
        args.released,
    )


EQUICONVERT_ENGINES = ("dptrainer", "dptrainer_graph", "make_private")


def noise_free_check(args, engine: str, model_name: str, device: torch.device) -> dict:
    """One noise-free step of the engine on `check_batch` examples against the per-example loop of its unit."""
    case = make_case(args, model_name, args.check_batch, device)
    case.noise = 0.0
    runner = ENGINES[engine].build(case, "fp32")
    if runner.unit == NONPRIVATE:
        return {}
    before = runner.params()
    runner.sync(runner.step())
    after = runner.params()
    reference = runner.reference
    images, labels, k, b = case.images, case.labels, case.aug_mult, len(case.images)
    reduce = REFERENCES[runner.unit]
    if reduce == "view":
        flat = case.views.flatten(0, 1)
        naive = naive_step(reference, flat, labels.repeat_interleave(k), 1, args.clip, args.lr, b * k, "mean")
    else:
        naive = naive_step(reference, images, labels, k, args.clip, args.lr, b, reduce)
    update = {n: after[n] - before[n] for n in before}
    expected = {n: (naive["after"][n] - naive["start"][n]).cpu() for n in before}
    return {
        "batch": b,
        "clipped_examples": sum(norm > args.clip for norm in naive["norms"]),
        "examples": len(naive["norms"]),
        "update_max_relative_difference": max(relative_difference(update[n], expected[n]) for n in before),
    }


def timed(runner: Runner, device: torch.device, warmup: int, iters: int) -> dict:
    for _ in range(warmup):
        runner.sync(runner.step())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        runner.sync(runner.step())
        times.append(time.perf_counter() - start)
    record = {"ms_per_step": 1e3 * statistics.median(times), "ms_per_step_each": [1e3 * t for t in times]}
    if runner.peak_memory is not None:
        record["peak_memory_gib"], record["peak_memory_measured_by"] = runner.peak_memory()
    elif device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        record["peak_memory_measured_by"] = "torch.cuda.max_memory_allocated over the timed steps"
    else:
        record["peak_memory_gib"] = None
        record["peak_memory_measured_by"] = "not measured on the CPU (torch.cuda.max_memory_allocated is CUDA only)"
    return record


def run_engine(args, engine: str, model_name: str, precision: str, device: torch.device) -> dict:
    """The engine's timing record on the full batch, with its noise-free check; {"not_run": why} or {"error": ...}."""
    runner = None
    try:
        check = noise_free_check(args, engine, model_name, device)
        _release(device)  # the check's model and engine hold no memory during the timing
        case = make_case(args, model_name, args.batch, device)
        runner = ENGINES[engine].build(case, precision)
        record = {
            "precision": runner.precision,
            "clipping_unit": runner.unit,
            **timed(runner, device, args.warmup, args.iters),
        }
        record["augmented_samples_per_s"] = 1e3 * args.batch * args.aug_mult / record["ms_per_step"]
        if engine in EQUICONVERT_ENGINES:  # what "fastest" had chosen per layer by then (one cache per process)
            record["filter_gradient_kernels"] = fastest_choices()
        if check:
            record["noise_free_check"] = check
        return record
    except NotRun as reason:
        return {"not_run": str(reason)}
    except Exception as error:  # noqa: BLE001  (one engine failing is a result of the side-by-side, not its end)
        return {"error": f"{type(error).__name__}: {error}".splitlines()[0]}
    finally:
        del runner
        _release(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_model(args, model_name: str, engines: list[str], device: torch.device) -> dict:
    torch.manual_seed(0)
    params = sum(p.numel() for p in (MODELS[model_name][1 if args.tiny else 0])().parameters())
    records: dict[str, dict] = {}
    baselines: dict[tuple[str, str], dict] = {}
    for engine in engines:
        spec = ENGINES[engine]
        precision = args.precision if args.precision in spec.precisions else "fp32"
        records[engine] = run_engine(args, engine, model_name, precision, device)
        print(
            model_name,
            engine,
            json.dumps({k: v for k, v in records[engine].items() if k != "ms_per_step_each"}),
            flush=True,
        )
        if spec.baseline is None or "ms_per_step" not in records[engine]:
            continue
        key = (spec.baseline, precision)
        if key not in baselines:
            baselines[key] = (
                records[spec.baseline]
                if spec.baseline in records and records[spec.baseline].get("precision") == precision
                else run_engine(args, spec.baseline, model_name, precision, device)
            )
        base = baselines[key]
        records[engine]["nonprivate_baseline"] = f"{spec.baseline} ({precision})"
        records[engine]["time_vs_own_nonprivate"] = (
            records[engine]["ms_per_step"] / base["ms_per_step"] if "ms_per_step" in base else None
        )
        if base is not records.get(spec.baseline):
            records[engine]["nonprivate_baseline_record"] = base
    return {"params": params, "description": MODELS[model_name][2], "engines": records}


def versions() -> dict:
    import opacus

    found = {"torch": torch.__version__, "opacus": opacus.__version__}
    jax = sys.modules.get("jax")  # imported only where a JAX engine ran
    found["jax"] = getattr(jax, "__version__", None)
    if jax is not None:  # None: TF32-class passes on GPUs for fp32 convs and matmuls, as torch's cuDNN default
        found["jax_default_matmul_precision"] = jax.config.jax_default_matmul_precision
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {sorted(MODELS)}")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {list(ENGINES)}")
    parser.add_argument("--batch", type=int, default=512, help="examples per step (B)")
    parser.add_argument("--aug-mult", type=int, default=4, help="views per example (K)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--clip", type=float, default=MAX_GRAD_NORM, help="max per-example gradient norm C")
    parser.add_argument("--noise", type=float, default=NOISE, help="noise multiplier sigma")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="fp32",
        help="bf16: the engines that allow it (nonprivate, dptrainer, dptrainer_graph, opacus_hooks, opacus_ghost) run under bf16 autocast; the others fp32",
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10, help="timed steps; the median is reported")
    parser.add_argument("--check-batch", type=int, default=4, help="examples in each engine's noise-free check")
    parser.add_argument(
        "--channels-last",
        action="store_true",
        help="the model's weights and the images in channels-last memory format for every PyTorch engine",
    )
    parser.add_argument("--fastdp", help="a checkout of github.com/awslabs/fast-differential-privacy")
    parser.add_argument("--released", help="a checkout of github.com/hlzl/equivariant at 3dd7cd0 (the paper's code)")
    parser.add_argument("--tiny", action="store_true", help=f"CPU smoke run: tiny models, defaults {TINY}")
    parser.add_argument("--out", default="benchmarks/results/dp_engines.json")
    if parser.parse_known_args(argv)[0].tiny:  # --tiny changes the defaults; flags given still apply
        parser.set_defaults(**TINY, device="cpu")
    args = parser.parse_args(argv)
    if args.tiny:
        torch.set_num_threads(1)  # tiny tensors: threads only contend
    models, engines = args.models.split(","), args.engines.split(",")
    for flag, names, known in (("--models", models, MODELS), ("--engines", engines, ENGINES)):
        if unknown := [n for n in names if n not in known]:
            parser.error(f"{flag}: unknown {unknown}; known: {list(known)}")
    for flag, value in (("--batch", args.batch), ("--aug-mult", args.aug_mult), ("--iters", args.iters)):
        if value < 1:
            parser.error(f"{flag} {value}: give at least 1")
    args.check_batch = min(args.check_batch, args.batch)
    device = torch.device(args.device)
    results = {name: run_model(args, name, engines, device) for name in models}
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/dp_engines.py", *(argv if argv is not None else sys.argv[1:])]),
        "card": card(device),
        "device": str(device),
        **versions(),
        "batch": args.batch,
        "aug_mult": args.aug_mult,
        "image_size": args.image_size,
        "clip": args.clip,
        "noise_multiplier": args.noise,
        "lr": args.lr,
        "precision": args.precision,
        "channels_last": args.channels_last,
        "warmup": args.warmup,
        "iters": args.iters,
        "tf32": {"cudnn": torch.backends.cudnn.allow_tf32, "matmul": torch.backends.cuda.matmul.allow_tf32},
        "fastdp_checkout": args.fastdp,
        "released_checkout": args.released,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
