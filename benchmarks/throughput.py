"""DP-SGD step time vs the non-private step of the same converted model on the same batch.

Methods, side by side in one process on one device, each on the same augmented
batch of B examples x K views of a converted ResNet9 (D4 unless --group says otherwise):
  nonprivate   forward/backward on the B*K views, SGD step (the floor)
  equiconvert  torch.func vmap over examples of grad over their K views (averaged
               before clipping), clipping, noise, step (DPTrainer's per_sample_method="vmap")
  bookkeeping  one forward/backward on the B*K views, per-layer per-example gradients
               from kept inputs and output gradients (DPTrainer's "bookkeeping"); a suffix
               :products, :grouped, :unfolded, :triton or :fastest fixes its conv filter-gradient kernel
               (DPTrainer's filter_gradients; default "auto", i.e. :fastest on CUDA)
  make_private equiconvert.privacy.make_private around the model and SGD: the user's own loop (forward on
               the (B, K, ...) views, loss.backward(), optimizer.step()), book-keeping per-example
               gradients, clipping and noise from secret generators; what an Opacus script gets by swapping
               its PrivacyEngine import
  opacus       Opacus GradSampleModule hooks (equiconvert's registered samplers) on
               the B*K views, per-example mean over views, clipping, noise, step
  nested_vmap  the paper's code's approach: vmap over examples of vmap over views
               of grad, summed over views, clipping, noise, step

--precision bf16 runs nonprivate and bookkeeping under bf16 autocast (DPTrainer's precision="bf16";
per-sample gradients, clipping and noise in fp32); the other methods are fp32 only.
Writes JSON (times in ms, throughput in augmented samples/s, peak memory, ratios).
Usage: python benchmarks/throughput.py --device cuda --batch 512 --aug-mult 4
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import equiconvert  # noqa: E402
from equiconvert.convert import fuse_norm_pools  # noqa: E402
from equiconvert.models import create_model  # noqa: E402
from equiconvert.training.augment import augment_views  # noqa: E402
from equiconvert.privacy.bookkeeping import per_sample_gradients_bookkeeping  # noqa: E402
from equiconvert.privacy.engine import make_private  # noqa: E402
from equiconvert.privacy.filter_gradients import fastest_choices, filter_gradient_method  # noqa: E402
from equiconvert.privacy.dp_step import clip_and_sum  # noqa: E402
from equiconvert.privacy.per_sample import per_sample_gradients  # noqa: E402
from equiconvert.privacy.backends import PRECISIONS  # noqa: E402

MAX_GRAD_NORM, NOISE = 2.0, 1.0


# the paper's released code (hlzl/equivariant), D4 Equivariant-ResNet9, timed with that code on an H200, fp32,
# physical batch 512 x 4 (docs/results.md)
PAPER_CODE_DP_SAMPLES_PER_S = 12_100


def build_model(
    name: str, widths: tuple[int, ...], kappa: float, device: torch.device, group: str = "D4", num_classes: int = 10
) -> torch.nn.Module:
    """ "resnet9": ResNet9 of `widths` converted to `group` at `kappa`; "paper": Hölzl et al.'s Equivariant-ResNet9.

    group "none": the unconverted network (for "paper", the plain network the preset converts).
    """
    if name == "paper":
        model = (
            create_model("plain_paper_resnet9", num_classes=num_classes)
            if group == "none"
            else create_model("equivariant_resnet9", group=group, num_classes=num_classes)
        )
    elif group == "none":
        from opacus.validators import ModuleValidator

        # BatchNorm -> GroupNorm, as `equiconvert train` does
        model = ModuleValidator.fix(create_model("resnet9", widths=widths, num_classes=num_classes))
    else:
        model = equiconvert.make_equivariant(
            create_model("resnet9", widths=widths, num_classes=num_classes), group, width=kappa, head="invariant"
        )
    return model.to(device).train()


def _noisy_step(
    model,
    optimizer,
    summed: dict[str, torch.Tensor],
    batch: int,
    noise_multiplier: float = NOISE,
    clip: float = MAX_GRAD_NORM,
) -> None:
    for name, param in model.named_parameters():
        noise = torch.randn_like(summed[name]) * (noise_multiplier * clip)
        param.grad = (summed[name] + noise) / batch
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_nonprivate_step(autocast_dtype: torch.dtype | None = None):
    """Forward/backward on the B*K views and an SGD step, under autocast in autocast_dtype if given."""

    def step(model, optimizer, views, labels):
        flat = views.flatten(0, 1)
        with torch.autocast(views.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(flat)
        loss = F.cross_entropy(logits.float(), labels.repeat_interleave(views.shape[1]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def make_equiconvert_step(
    chunk: int, method: str = "vmap", autocast_dtype: torch.dtype | None = None, filter_gradients: str = "auto"
):
    """DPTrainer's computation: the batch in chunks of `chunk` examples (as its physical batches), per-sample
    gradients by torch.func vmap or by book-keeping (under autocast in autocast_dtype if given, its conv filter
    gradients by the `filter_gradients` kernel)."""

    def step(model, optimizer, views, labels):
        params = {n: p.detach() for n, p in model.named_parameters()}
        buffers = dict(model.named_buffers())
        summed = {n: torch.zeros_like(p) for n, p in params.items()}
        for start in range(0, views.shape[0], chunk):
            part, part_labels = views[start : start + chunk], labels[start : start + chunk]
            if method == "bookkeeping":
                with filter_gradient_method(filter_gradients, timing_examples=chunk):
                    grads, _ = per_sample_gradients_bookkeeping(model, part, part_labels, autocast_dtype=autocast_dtype)
            else:
                grads, _ = per_sample_gradients(model, params, buffers, part, part_labels)
            clipped, _ = clip_and_sum(grads, MAX_GRAD_NORM)
            for name, value in clipped.items():
                summed[name] += value
        _noisy_step(model, optimizer, summed, views.shape[0])

    return step


def view_summed_gradients(model, views, labels) -> dict[str, torch.Tensor]:
    """The paper's code's per-example gradients: vmap over examples of vmap over views of grad, each example's K
    view gradients summed (views: B x K x C x H x W)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def view_loss(p, image, label):
        return F.cross_entropy(functional_call(model, (p, buffers), (image.unsqueeze(0),)), label.unsqueeze(0))

    per_view = vmap(vmap(grad(view_loss), in_dims=(None, 0, None)), in_dims=(None, 0, 0), randomness="different")
    return {n: g.sum(1) for n, g in per_view(params, views, labels).items()}


def step_nested_vmap(model, optimizer, views, labels, clip: float = MAX_GRAD_NORM, noise_multiplier: float = NOISE):
    summed, _ = clip_and_sum(view_summed_gradients(model, views, labels), clip)
    _noisy_step(model, optimizer, summed, views.shape[0], noise_multiplier, clip)


def make_private_step(model):
    """The make_private loop: zero_grad, forward on the views, loss.backward(), optimizer.step().

    make_private wraps the model and the benchmark's optimizer at the first call; its data loader (one batch of
    the whole benchmark set, q = 1) only sets the expected batch size, B, as the other methods divide by.
    """
    wrapped: dict[str, object] = {}

    def step(_model, optimizer, views, labels):
        if not wrapped:
            loader = DataLoader(TensorDataset(torch.arange(views.shape[0])), batch_size=views.shape[0])
            wrapped["module"], wrapped["optimizer"], _ = make_private(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                noise_multiplier=NOISE,
                max_grad_norm=MAX_GRAD_NORM,
                aug_mult=views.shape[1],
            )
        module, dp_optimizer = wrapped["module"], wrapped["optimizer"]
        dp_optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(module(views), labels.repeat_interleave(views.shape[1])).backward()
        dp_optimizer.step()

    return step


def make_opacus_step(model):
    from opacus import GradSampleModule

    import equiconvert.privacy.opacus_interop  # noqa: F401  (registers the samplers)

    wrapped = GradSampleModule(model)

    def step(_model, optimizer, views, labels):
        batch, views_per = views.shape[:2]
        loss = F.cross_entropy(wrapped(views.flatten(0, 1)), labels.repeat_interleave(views_per), reduction="sum")
        loss.backward()
        grads = {n: p.grad_sample.reshape(batch, views_per, *p.shape).mean(1) for n, p in model.named_parameters()}
        for p in model.parameters():
            p.grad_sample = None
        summed, _ = clip_and_sum(grads, MAX_GRAD_NORM)
        _noisy_step(model, optimizer, summed, batch)

    return step, wrapped


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_method(step, model, views, labels, device, warmup: int, iters: int) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(warmup):
        step(model, optimizer, views, labels)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(iters):
        step(model, optimizer, views, labels)
    _sync(device)
    seconds = (time.perf_counter() - start) / iters
    record = {
        "ms_per_step": 1e3 * seconds,
        "augmented_samples_per_s": views.shape[0] * views.shape[1] / seconds,
        "examples_per_s": views.shape[0] / seconds,
    }
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=512, help="physical batch: examples per step")
    parser.add_argument("--aug-mult", type=int, default=4)
    parser.add_argument(
        "--model",
        choices=("resnet9", "paper"),
        default="resnet9",
        help="paper: the D4 Equivariant-ResNet9 of Hölzl et al. (255,675 params; --widths/--kappa unused)",
    )
    parser.add_argument("--widths", default="64,128,256", help="ResNet9 channel widths before conversion")
    parser.add_argument("--group", default="D4", help='symmetry group of the conversion, or "none" (unconverted)')
    parser.add_argument(
        "--num-classes",
        type=int,
        default=10,
        help="classes of the head (1000: the paper's ImageNet32 model, 411,105 params)",
    )
    parser.add_argument("--kappa", type=float, default=1.5, help="width constant of the conversion")
    parser.add_argument(
        "--methods",
        default="nonprivate,equiconvert,bookkeeping,make_private,opacus,nested_vmap",
        help="equiconvert@N / bookkeeping@N process the batch in chunks of N examples (DPTrainer's physical batches)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="let cuDNN time its algorithms per shape (torch.backends.cudnn.benchmark) for every method",
    )
    parser.add_argument(
        "--precision",
        choices=tuple(PRECISIONS),
        default="fp32",
        help="bf16: nonprivate and bookkeeping under bf16 autocast (the other methods are fp32 only)",
    )
    parser.add_argument(
        "--fuse-norm-pools",
        action="store_true",
        help="fuse each affine-free FieldGroupNorm and the window max pool after it (equiconvert.convert."
        "fuse_norm_pools), which conversion does not do",
    )
    parser.add_argument("--out", default="benchmarks/results/throughput.json")
    args = parser.parse_args(argv)
    fp32_only = [
        m for m in args.methods.split(",") if m.partition("@")[0].partition(":")[0] not in ("nonprivate", "bookkeeping")
    ]
    if args.precision != "fp32" and fp32_only:
        parser.error(f"--precision {args.precision} applies to nonprivate and bookkeeping only; drop {fp32_only}")
    autocast_dtype = PRECISIONS[args.precision]
    torch.backends.cudnn.benchmark = args.cudnn_benchmark

    device = torch.device(args.device)
    torch.manual_seed(0)
    widths = tuple(int(w) for w in args.widths.split(","))
    images = torch.randn(args.batch, 3, 32, 32, device=device)
    views = augment_views(images, args.aug_mult, torch.Generator(device=device).manual_seed(0))
    labels = torch.randint(0, args.num_classes, (args.batch,), device=device)
    results: dict[str, dict] = {}
    params = fused = None
    for method in args.methods.split(","):
        model = build_model(args.model, widths, args.kappa, device, args.group, args.num_classes)
        if args.fuse_norm_pools:
            fused = fuse_norm_pools(model)
        params = sum(p.numel() for p in model.parameters())
        step = {"nonprivate": make_nonprivate_step(autocast_dtype), "nested_vmap": step_nested_vmap}.get(method)
        if method.startswith("equiconvert") or method.startswith("bookkeeping"):
            kind = "bookkeeping" if method.startswith("bookkeeping") else "vmap"
            name, _, kernel = method.partition(":")
            step = make_equiconvert_step(
                int(name.partition("@")[2] or args.batch), kind, autocast_dtype, kernel or "auto"
            )
        if method == "opacus":
            step, _ = make_opacus_step(model)
        if method == "make_private":
            step = make_private_step(model)
        try:
            results[method] = time_method(step, model, views, labels, device, args.warmup, args.iters)
        except torch.cuda.OutOfMemoryError as error:  # recorded, not hidden
            results[method] = {"error": f"out of memory: {error}".splitlines()[0]}
        finally:
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(method, json.dumps(results[method]), flush=True)
    base = results.get("nonprivate", {}).get("ms_per_step")
    for method, record in results.items():
        if base and "ms_per_step" in record:
            record["time_vs_nonprivate"] = record["ms_per_step"] / base
            if method != "nonprivate":
                record["dp_throughput_vs_paper_code"] = record["augmented_samples_per_s"] / PAPER_CODE_DP_SAMPLES_PER_S
            if "peak_memory_gib" in record and "peak_memory_gib" in results["nonprivate"]:
                record["memory_vs_nonprivate"] = record["peak_memory_gib"] / results["nonprivate"]["peak_memory_gib"]
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/throughput.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "equiconvert": str(Path(equiconvert.__file__).resolve().parent),  # which checkout ran: crossover.py checks it
        "model": {
            "name": args.model,
            "widths": widths if args.model == "resnet9" else None,
            "group": args.group,
            "kappa": args.kappa if args.model == "resnet9" else None,
            "params": params,
            "fused_norm_pools": fused,  # how many pairs --fuse-norm-pools fused; None without it
        },
        "paper_code_dp_samples_per_s": PAPER_CODE_DP_SAMPLES_PER_S,
        "batch": args.batch,
        "aug_mult": args.aug_mult,
        "dtype": "float32",
        "autocast": args.precision if args.precision != "fp32" else None,
        "tf32": {"cudnn": torch.backends.cudnn.allow_tf32, "matmul": torch.backends.cuda.matmul.allow_tf32},
        "cudnn_benchmark": args.cudnn_benchmark,
        "results": results,
        "fastest_filter_gradient_kernels": fastest_choices(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(
        json.dumps(
            {
                k: {m: round(r.get("time_vs_nonprivate", float("nan")), 2) for m, r in results.items()}
                for k in ["time_vs_nonprivate"]
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
