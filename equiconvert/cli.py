"""Command line: `equiconvert convert MODEL --group D4 ...` and `equiconvert demo`.

`convert` builds a model by its registry name (equiconvert.models.create_model), converts it,
measures its equivariance error at a valid input size and prints the conversion
report (readable, or one JSON object with --json). `demo` is the package's main
job (equiconvert.recipes.demo): ResNet9 converted to D4 and trained with DP-SGD on
Fashion-MNIST; `demo --conversion-only` converts and checks two reference networks.

User errors (unknown model, group, width, a model that cannot be converted) print
one `error: ...` line to stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Sequence

import torch

JSON_VALID_SIZES = 16  # how many valid input sizes the JSON output lists
CHECK_BATCH_SIZE = 1  # the equivariance check's batch; the error does not depend on it
EXIT_USAGE = 2


class CLIError(Exception):
    """A user error: reported as one `error: ...` line and exit status 2."""


# --- converting and checking ------------------------------------------------------------


def _width(text: str) -> str | float:
    if text in ("kappa", "params", "channels"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'kappa', 'params', 'channels' or a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"kappa must be positive, got {text}")
    return value


def check_size(model, requested: int | None) -> int | None:
    """Where to measure equivariance: the requested size if valid, else the model's default.

    None when the model has no valid size and none was requested.
    """
    if requested is not None and model.report.input_size_valid:
        return requested
    try:
        return model.default_input_size()
    except ValueError:  # no size keeps exact equivariance: measure the requested one anyway
        return requested


def convert_and_check(
    model_spec: str,
    group: str,
    *,
    input_size: int | None = None,
    width: str | float | None = None,
    head: str | None = None,
    num_classes: int = 10,
    in_channels: int = 3,
    strict: bool = False,
    check: bool = True,
    pretrained: bool | str = False,
    pad_to_valid: bool = False,
    crop_to_valid: bool = False,
) -> tuple[Any, dict]:
    """Build, convert and (optionally) check one model; returns (EquivariantModel, JSON record).

    A model that is equivariant by construction (the paper's preset) is built for `group` instead of converted.
    """
    from . import check_equivariance, make_equivariant, parse_group
    from .models import create_model
    from .models._registry import is_equivariant_model

    spec = parse_group(group)  # fail on a bad group before building anything
    options = {"width": width, "input_size": input_size, "strict": strict or None, "head": head}
    if is_equivariant_model(model_spec):
        if pretrained or pad_to_valid or crop_to_valid:
            raise CLIError(f"{model_spec} is built equivariant: --pretrained, --pad-to-valid and --crop-to-valid "
                           "apply to converted models only")
        start = time.perf_counter()
        converted = create_model(model_spec, group=group, num_classes=num_classes, in_channels=in_channels, **options)
    else:
        model = create_model(model_spec, num_classes=num_classes, in_channels=in_channels,
                             pretrained=pretrained or None)
        start = time.perf_counter()
        converted = make_equivariant(model, spec, pretrained=bool(pretrained), pad_to_valid=pad_to_valid,
                                     crop_to_valid=crop_to_valid, **options)
    conversion_time = time.perf_counter() - start
    report = converted.report

    equivariance = None
    size = check_size(converted, input_size) if check else None
    if size is not None:
        start = time.perf_counter()
        result = check_equivariance(converted, input_size=size, batch_size=CHECK_BATCH_SIZE)
        report.max_equivariance_error = result.max_error
        equivariance = {
            "input_size": size,
            "input_size_valid": size in report.valid_input_sizes,
            "errors": dict(result.errors),
            "max_error": result.max_error,
            "check_time_s": round(time.perf_counter() - start, 3),
        }

    record = report.to_dict()
    record["num_valid_input_sizes"] = len(report.valid_input_sizes)
    record["valid_input_sizes"] = report.valid_input_sizes[:JSON_VALID_SIZES]
    record.update(
        model=model_spec,
        group=spec.name,
        conversion_time_s=round(conversion_time, 3),
        equivariance=equivariance,
    )
    return converted, record


def _check_summary(record: dict) -> str:
    eq = record["equivariance"]
    if eq is None:
        return "equivariance not checked"
    valid = "" if eq["input_size_valid"] else " (NOT a valid size: errors are not expected to be small)"
    lines = [f"equivariance check at input size {eq['input_size']}{valid}: max error {eq['max_error']:.2e}"]
    lines += [f"  {element}: {error:.2e}" for element, error in eq["errors"].items()]
    return "\n".join(lines)


# --- subcommands -----------------------------------------------------------------------------


def _cmd_convert(args: argparse.Namespace) -> int:
    # escnn or a model factory might print; keep stdout clean for the JSON object
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        converted, record = convert_and_check(
            args.model, args.group, input_size=args.input_size, width=args.width, head=args.head,
            num_classes=args.num_classes, in_channels=args.in_channels, strict=args.strict, check=not args.no_check,
            pretrained=args.pretrained, pad_to_valid=args.pad_to_valid, crop_to_valid=args.crop_to_valid,
        )
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"model {args.model}, converted in {record['conversion_time_s']:.2f} s")
    print(converted.report)
    print(_check_summary(record))
    return 0


DEMO_MODELS: tuple[tuple[str, dict], ...] = (
    ("torchvision:resnet18", {"num_classes": 10}),
    ("equiconvert:resnet9", {"num_classes": 10, "head": "invariant", "input_size": 32}),
)


def run_demo(group: str = "D4") -> dict:
    """Convert and check the demo models; returns a JSON-ready summary of each."""
    start = time.perf_counter()
    models = []
    for spec, options in DEMO_MODELS:
        _, record = convert_and_check(spec, group, **options)
        changes = record["layers"]
        inserted = sum(change["before"] == "(inserted)" for change in changes)
        models.append({
            "model": spec,
            "group": record["group"],
            "width": record["width"],
            "params_before": record["params_before"],
            "params_after": record["params_after"],
            "valid_input_rule": record["valid_input_rule"],
            "valid_input_sizes": record["valid_input_sizes"],
            "layers_swapped": len(changes) - inserted,
            "layers_inserted": inserted,
            "invariant_output": record["invariant_output"],
            "warnings": [w["text"] for w in record["warnings"]],
            "check_input_size": record["equivariance"]["input_size"],
            "max_equivariance_error": record["max_equivariance_error"],
            "conversion_time_s": record["conversion_time_s"],
            "check_time_s": record["equivariance"]["check_time_s"],
        })
    return {"group": group, "models": models, "total_time_s": round(time.perf_counter() - start, 3)}


def _print_demo(summary: dict) -> None:
    for m in summary["models"]:
        print(f"== {m['model']} -> {m['group']} (width {m['width']})")
        print(f"  parameters: {m['params_before']:,} -> {m['params_after']:,}")
        print(f"  valid input sizes: {m['valid_input_rule']}")
        print(f"  layers swapped: {m['layers_swapped']} (+{m['layers_inserted']} inserted); "
              f"output {'invariant' if m['invariant_output'] else 'NOT invariant'}")
        print(f"  warnings: {len(m['warnings'])}")
        for warning in m["warnings"]:
            print(f"    {warning}")
        print(f"  max equivariance error at {m['check_input_size']}x{m['check_input_size']}: "
              f"{m['max_equivariance_error']:.2e}")
        print(f"  time: conversion {m['conversion_time_s']:.2f} s, check {m['check_time_s']:.2f} s")
    print(f"total wall time: {summary['total_time_s']:.1f} s")


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.conversion_only:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            summary = run_demo(args.group or "D4")
        if args.json:
            print(json.dumps(summary))
        else:
            _print_demo(summary)
        return 0
    return _demo_training(args)


def demo_settings(args: argparse.Namespace):
    """demo.CPU_DEFAULTS with the flags that were given (`--time-limit 0`: no cap)."""
    from .recipes.demo import CPU_DEFAULTS, settings_from

    settings = settings_from(
        CPU_DEFAULTS, dataset=args.dataset, data_dir=args.data_dir, group=args.group, widths=args.widths,
        epsilon=args.epsilon, delta=args.delta, batch_size=args.batch_size, physical_batch_size=args.physical_batch_size,
        steps=args.steps, aug_mult=args.aug_mult, max_grad_norm=args.max_grad_norm, lr=args.lr,
        momentum=args.momentum, seed=args.seed, time_limit_s=args.time_limit, device=args.device, threads=args.threads,
        init_gain=args.init_gain,
        out=args.out, progress=False if args.no_progress else None,
    )
    if args.time_limit == 0:  # no cap
        settings = dataclasses.replace(settings, time_limit_s=None)
    return settings


def _demo_training(args: argparse.Namespace) -> int:
    """The main job: ResNet9 -> D4, DP-SGD on Fashion-MNIST, with demo.CPU_DEFAULTS unless flags say otherwise."""
    from .data import DatasetNotFoundError
    from .recipes.demo import format_summary, run_main_job

    s = demo_settings(args)
    if not args.json:
        cap = f"training capped at {s.time_limit_s:.0f} s" if s.time_limit_s else "no time cap"
        print(f"equiconvert demo: {s.model} (widths {','.join(map(str, s.widths))}) -> {s.group}, DP-SGD on "
              f"{s.dataset}, epsilon {s.epsilon:g}, delta {s.delta:g}, {s.steps} steps of batch {s.batch_size} "
              f"({cap}); output in {s.out}", flush=True)
    try:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            summary = run_main_job(s)
    except DatasetNotFoundError as exc:
        raise CLIError(f"{exc} For the demo: pass --data-dir DIR, or install the Debian package "
                       f"dataset-fashion-mnist (sudo apt-get install dataset-fashion-mnist).") from exc
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


# `equiconvert train`'s numeric flags (argparse dest), each with its test and the error's rule: checked before any
# data or model is loaded
_TRAIN_LIMITS: dict[str, tuple[Callable[[float], bool], str]] = {
    "epsilon": (lambda v: v > 0, "must be > 0"),
    "delta": (lambda v: 0 < v < 1, "must be in (0, 1)"),
    "noise_multiplier": (lambda v: v > 0, "must be > 0"),
    "batch_size": (lambda v: v >= 1, "must be >= 1"),
    "physical_batch_size": (lambda v: v >= 1, "must be >= 1"),
    "steps": (lambda v: v >= 1, "must be >= 1"),
    "aug_mult": (lambda v: v >= 1, "must be >= 1"),
    "max_grad_norm": (lambda v: v > 0, "must be > 0"),
    "lr": (lambda v: v > 0, "must be > 0"),
    "momentum": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "crop_padding": (lambda v: v >= 0, "must be >= 0"),
    "ema_decay": (lambda v: 0 <= v < 1, "must be in [0, 1) (0: no EMA)"),
    "eval_every": (lambda v: v >= 1, "must be >= 1"),
    "checkpoint_every": (lambda v: v >= 0, "must be >= 0 (0: none)"),
    "time_limit": (lambda v: v > 0, "must be > 0 seconds"),
    "threads": (lambda v: v >= 1, "give at least 1 CPU thread"),
}


def _check_train_args(args: argparse.Namespace) -> None:
    """Every numeric flag of `train` in range, and the data set known, before any data or model is touched."""
    from .data import resolve_name

    for dest, (valid, rule) in _TRAIN_LIMITS.items():
        value = getattr(args, dest)
        if value is not None and not valid(value):
            raise CLIError(f"--{dest.replace('_', '-')} {value:g}: {rule}")
    resolve_name(args.dataset)


def _cmd_train(args: argparse.Namespace) -> int:
    from .recipes.runner import RunSpec, run_training

    _check_train_args(args)
    if args.nproc_per_node is not None:
        return _launch_train(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    spec = RunSpec(model=args.model, group=args.group, dataset=args.dataset, data_dir=args.data_dir, out=args.out,
                   width=args.width, model_widths=args.widths, device=args.device, resume=args.resume,
                   overwrite=args.overwrite,
                   progress=not args.no_progress, time_limit_s=args.time_limit, init_gain=args.init_gain,
                   head=args.head, activation=args.activation, norm_groups=args.norm_groups,
                   res2=False if args.no_res2 else None, pool_after_res2=args.pool_after_res2 or None)
    normalize = {} if args.normalize is None else dict(zip(("normalize_mean", "normalize_std"), args.normalize))
    result = run_training(
        spec, target_epsilon=args.epsilon, delta=args.delta, batch_size=args.batch_size, steps=args.steps,
        aug_mult=args.aug_mult, max_grad_norm=args.max_grad_norm, lr=args.lr, momentum=args.momentum,
        optimizer=args.optimizer, lr_schedule=args.lr_schedule, augment_flip=not args.no_flip,
        augment_padding=args.crop_padding, ema_decay=args.ema_decay or None, accountant=args.accountant,
        noise_multiplier=args.noise_multiplier, physical_batch_size=args.physical_batch_size, seed=args.seed,
        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every, per_sample_method=args.per_sample,
        precision=args.precision, filter_gradients=args.filter_gradients, test_shifts=args.test_shifts, **normalize,
        insecure_seeded_noise=args.insecure_seeded_noise, log_nonprivate_stats=args.log_nonprivate_stats,
    )
    if os.environ.get("RANK", "0") == "0":  # one printout per job (torchrun numbers its workers in RANK)
        print(json.dumps(result, indent=2))
    return 0


def _launch_train(args: argparse.Namespace) -> int:
    """`train --nproc-per-node N`: the same command on N local workers, started by torchrun's own entry point."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .privacy import distributed

    if args.nproc_per_node < 1:
        raise CLIError(f"--nproc-per-node {args.nproc_per_node}: give at least 1 worker")
    if distributed.launched_world_size() > 1:
        raise CLIError("--nproc-per-node starts its own workers: drop it when launching with torchrun")
    try:
        distributed.launch(args.nproc_per_node, "equiconvert", _without_option(args.argv, "--nproc-per-node"))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise CLIError(f"training worker {rank} exited with code {failure.exitcode}; its error is above") from exc
    return 0


def _without_option(argv: Sequence[str], flag: str) -> list[str]:
    """`argv` without `flag VALUE` / `flag=VALUE`."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == flag:
            skip = True
        elif not item.startswith(flag + "="):
            kept.append(item)
    return kept


def _add_train_parser(sub) -> None:
    from .models.equivariant_resnet9 import PAPER_ACTIVATIONS
    from .privacy.augment import TEST_SHIFTS
    from .privacy.filter_gradients import FILTER_GRADIENT_METHODS

    train = sub.add_parser("train", help="train a (converted) model with DP-SGD and write OUT/result.json")
    train.add_argument("--model", default="equiconvert:resnet9",
                       help="a registry name (equiconvert.models.list_models()): resnet9, equivariant_resnet9 (Hölzl et "
                            "al.'s model for --group; with --group none the plain network it converts), "
                            "torchvision:<name>, timm:<name>; bare names: equiconvert's, then torchvision's, then timm's")
    train.add_argument("--group", default="D4", help="C1..C16, D1..D16, or 'none' for the unconverted baseline")
    train.add_argument("--dataset", required=True, help="fashion-mnist, cifar10, rotated-mnist, imagenet32, imagefolder, synthetic")
    train.add_argument("--data-dir", default=None)
    train.add_argument("--out", required=True, help="output folder (log.jsonl, checkpoint.pt, result.json)")
    train.add_argument("--epsilon", type=float, default=8.0)
    train.add_argument("--delta", type=float, default=None,
                       help="default: 1e-5 while 1e-5 <= 1/(10 N), else the largest power of ten <= 1/(10 N); "
                            "refused at >= 1/N")
    train.add_argument("--noise-multiplier", type=float, default=None, help="default: calibrated from --epsilon")
    train.add_argument("--accountant", choices=("rdp", "prv"), default="rdp")
    train.add_argument("--batch-size", type=int, default=2048, help="expected logical (Poisson) batch size")
    train.add_argument("--physical-batch-size", type=int, default=256)
    train.add_argument("--steps", type=int, default=500)
    train.add_argument("--aug-mult", type=int, default=4)
    train.add_argument("--max-grad-norm", type=float, default=2.0)
    train.add_argument("--lr", type=float, default=2.0)
    train.add_argument("--momentum", type=float, default=0.0)
    train.add_argument("--optimizer", choices=("sgd", "nadam"), default="sgd")
    train.add_argument("--per-sample", choices=("auto", "bookkeeping", "vmap"), default="auto",
                       help="per-sample gradients: book-keeping (fastest, least memory measured), torch.func vmap "
                            "(any model), or auto: book-keeping where the model allows it")
    train.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                       help="bf16: forward and backward under bf16 autocast (book-keeping only); per-sample gradients, "
                            "clipping and noise stay fp32")
    train.add_argument("--filter-gradients", choices=FILTER_GRADIENT_METHODS, default="auto",
                       help="book-keeping's per-example conv filter gradients: batched products per tap, cuDNN's "
                            "grouped weight gradient, or the taps unfolded into one product; auto: the fastest "
                            "per layer on CUDA (timed once), grouped on CPU")
    train.add_argument("--no-flip", action="store_true",
                       help="augment by crops only (digits: a flipped 2 is not a 2)")
    train.add_argument("--crop-padding", type=int, default=4, metavar="PIXELS",
                       help="random crops of the reflection-padded image shift it by up to this many pixels (default "
                            "4, CIFAR's; 0: no crops)")
    train.add_argument("--test-shifts", choices=sorted(TEST_SHIFTS), default=None,
                       help="also report test metrics with the softmax averaged over these shifted copies of each test "
                            "image (cross1: the image and its four 1-pixel shifts; grid1: all nine); result.json keeps "
                            "the plain ones as test_accuracy and adds test_accuracy_shift_averaged")
    train.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    train.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                       help="stop training after this long, with a checkpoint; --resume continues the run")
    train.add_argument("--ema-decay", type=float, default=0.999, help="0 disables the EMA")
    train.add_argument("--width", type=_width, default=None, help="width policy of the conversion")
    train.add_argument("--init-gain", type=float, default=None,
                       help="initial std of the steerable filters, gain/sqrt(fan-in) (default: the model's, He's sqrt(2) "
                            "for conversions, 1/sqrt(2) for equiconvert:equivariant_resnet9; 1 is escnn's scale); under "
                            "weight standardization lower gains make the filters learn faster")
    train.add_argument("--widths", type=_widths, default=None,
                       help="channel widths of equiconvert:resnet9 before conversion, e.g. 16,32,64")
    train.add_argument("--head", choices=("keep", "invariant"), default=None,
                       help="the converted model's head: 'invariant' (global pooling; the default, except for "
                            "equiconvert:equivariant_resnet9) or 'keep' (the network's own, e.g. the paper's 2x2 pooling)")
    train.add_argument("--activation", choices=tuple(PAPER_ACTIVATIONS), default=None,
                       help="equiconvert:equivariant_resnet9's activation, for it and its unconverted network (default: "
                            "the paper's mish)")
    train.add_argument("--norm-groups", type=int, default=None,
                       help="equiconvert:equivariant_resnet9's GroupNorm groups, for it and its unconverted network "
                            "(default: the paper's 8; a converted norm takes groups of whole fields, at most one per field)")
    train.add_argument("--no-res2", action="store_true",
                       help="equiconvert:equivariant_resnet9 (and its unconverted network) without the last residual "
                            "block, res2: about half the parameters, so less DP-SGD noise in all (not the paper's)")
    train.add_argument("--pool-after-res2", action="store_true",
                       help="equiconvert:equivariant_resnet9 (and its unconverted network) with layer3's pooling after "
                            "res2, which then works on 8x8 maps instead of 4x4: the same parameters, more FLOPs "
                            "(not the paper's)")
    train.add_argument("--normalize", type=_mean_std, default=None,
                       metavar="MEAN,STD", help="pixels in [0, 1] -> (x - MEAN) / STD on the training device "
                                                "(default 0.5,0.5; Fashion-MNIST's own statistics: 0.286,0.353)")
    train.add_argument("--eval-every", type=int, default=None)
    train.add_argument("--checkpoint-every", type=int, default=50)
    train.add_argument("--seed", type=int, default=0,
                       help="initial weights, augmentation and data order (never the DP noise or sampling, which are "
                            "secret unless --insecure-seeded-noise)")
    train.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    train.add_argument("--threads", type=int, default=None,
                       help="CPU threads of this process (default: PyTorch's, one per core); give several runs on "
                            "one host a share each")
    train.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (which must exist)")
    train.add_argument("--overwrite", action="store_true",
                       help="replace the earlier run in OUT (a non-empty OUT is refused otherwise)")
    train.add_argument("--insecure-seeded-noise", action="store_true",
                       help="NOT PRIVATE: seed the DP noise and batch sampling from --seed (reproducible runs for "
                            "tests and debugging); result.json records private: false")
    train.add_argument("--log-nonprivate-stats", action="store_true",
                       help="NOT PRIVATE: log each step's noise-free training loss and actual batch size")
    train.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                       help="train on N local processes (GPUs) at once, started as torchrun --standalone "
                            "--nproc-per-node N would (docs/multi-gpu.md); for several nodes use torchrun itself")
    train.add_argument("--no-progress", action="store_true")
    train.set_defaults(handler=_cmd_train)


def _mean_std(text: str) -> tuple[float, float]:
    try:
        mean, std = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MEAN,STD, e.g. 0.286,0.353") from None
    if not std > 0:
        raise argparse.ArgumentTypeError(f"the STD of --normalize must be positive, got {std:g}")
    return mean, std


def _widths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 16,32,64") from None


def _add_demo_parser(sub) -> None:
    from .recipes.demo import CPU_DEFAULTS as d

    demo = sub.add_parser(
        "demo", help="the main job: convert ResNet9 to D4 and train it with DP-SGD on Fashion-MNIST",
        description="Convert equiconvert's ResNet9 to D4, train it with DP-SGD on Fashion-MNIST (Poisson sampling, "
                    "RDP accounting) and print and write OUT/demo.json: test accuracy, epsilon/delta, parameters, "
                    "equivariance error, wall time. Defaults (equiconvert.recipes.demo.CPU_DEFAULTS) finish within 15 minutes "
                    "on a 2-core CPU; flags take bigger settings, e.g. --device cuda --steps 1000 --batch-size 2048.")
    demo.add_argument("--conversion-only", action="store_true",
                      help="only convert and check torchvision resnet18 and equiconvert resnet9 (no training)")
    demo.add_argument("--group", default=None, help=f"default {d.group}")
    demo.add_argument("--dataset", default=None, help=f"default {d.dataset} (any name `equiconvert train` takes)")
    demo.add_argument("--data-dir", default=None,
                      help="directory of the Fashion-MNIST IDX .gz files (default: $EQUICONVERT_DATA_DIR, then "
                           "/usr/share/datasets/fashion-mnist of the Debian package dataset-fashion-mnist)")
    demo.add_argument("--out", default=None, help=f"output folder, default {d.out} (its old results are replaced)")
    demo.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    demo.add_argument("--widths", type=_widths, default=None,
                      help=f"ResNet9 channel widths before conversion, default {','.join(map(str, d.widths))}")
    demo.add_argument("--steps", type=int, default=None, help=f"default {d.steps}")
    demo.add_argument("--batch-size", type=int, default=None, help=f"expected (Poisson) batch size, default {d.batch_size}")
    demo.add_argument("--physical-batch-size", type=int, default=None, help=f"default {d.physical_batch_size}")
    demo.add_argument("--aug-mult", type=int, default=None, help=f"augmented views per example, default {d.aug_mult}")
    demo.add_argument("--lr", type=float, default=None, help=f"default {d.lr}")
    demo.add_argument("--momentum", type=float, default=None, help=f"default {d.momentum}")
    demo.add_argument("--max-grad-norm", type=float, default=None, help=f"default {d.max_grad_norm}")
    demo.add_argument("--epsilon", type=float, default=None, help=f"default {d.epsilon}")
    demo.add_argument("--delta", type=float, default=None, help=f"default {d.delta}")
    demo.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                      help=f"cap on the training time, default {d.time_limit_s:.0f}; 0: none. A capped run says at which "
                           f"step it stopped and the epsilon it spent")
    demo.add_argument("--threads", type=int, default=None, help="CPU threads (default: the cores this process may use)")
    demo.add_argument("--seed", type=int, default=None, help=f"default {d.seed}")
    demo.add_argument("--init-gain", type=float, default=None,
                      help=f"initial std of the steerable filters, gain/sqrt(fan-in), default {d.init_gain:.4f}")
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(handler=_cmd_demo)


def _cmd_audit(args: argparse.Namespace) -> int:
    """One-run privacy audit (equiconvert.privacy.audit): print and write OUT/audit.json."""
    from pathlib import Path

    from .data import load_dataset
    from .privacy.audit import AUDIT_DEFAULTS, SMALL_MODELS, make_canaries, run_audit

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CLIError(f"--out {out} exists and is not an empty folder; give a new or empty one")
    if args.guesses < 1 or 2 * args.guesses > args.canaries:
        raise CLIError(f"--guesses {args.guesses}: give k >= 1 with 2k at most --canaries ({args.canaries})")
    if not 0.0 < args.confidence < 1.0:
        raise CLIError(f"--confidence {args.confidence}: give a number in (0, 1), e.g. 0.95")
    if args.num_examples is not None and args.num_examples < 1:
        raise CLIError(f"--num-examples {args.num_examples}: give at least 1 (or leave it out for all)")
    data = load_dataset(args.dataset, args.data_dir)
    images, labels = data.as_tuple()
    if args.num_examples is not None:
        images, labels = images[:args.num_examples], labels[:args.num_examples]
    torch.manual_seed(args.seed)  # the model's initial weights
    model = SMALL_MODELS[args.model](data.image_shape, data.num_classes)
    canaries = make_canaries(data.image_shape, data.num_classes, args.canaries, seed=args.seed + 1)
    given = {"target_epsilon": args.epsilon, "delta": args.delta, "noise_multiplier": args.noise_multiplier,
             "steps": args.steps, "batch_size": args.batch_size, "max_grad_norm": args.max_grad_norm, "lr": args.lr,
             "seed": args.seed}
    options = {**AUDIT_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    if args.noise_multiplier is not None and args.epsilon is None:  # a fixed sigma: no budget to stop at
        options["target_epsilon"] = None
    result = run_audit(model, (images, labels), canaries, guesses_included=args.guesses, guesses_excluded=args.guesses,
                       score=args.score, beta=1.0 - args.confidence, inclusion_seed=args.seed, device=args.device,
                       **options)
    record = json.dumps(result.to_dict(), indent=2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(record + "\n")
    print(record)
    return 0


def _add_audit_parser(sub) -> None:
    from .privacy.audit import AUDIT_DEFAULTS, DEFAULT_BETA, SCORES, SMALL_MODELS

    audit = sub.add_parser(
        "audit", help="empirical lower bound on epsilon from one DP-SGD run with canaries",
        description="Train a small model once with DP-SGD on DATASET plus a random half of --canaries random-pixel, "
                    "random-label canaries, guess which canaries were trained on, and turn the correct guesses into "
                    "a lower bound on epsilon (Steinke, Nasr, Jagielski 2023), printed beside the accountant's "
                    "epsilon and written to OUT/audit.json.")
    audit.add_argument("--out", required=True, help="output folder for audit.json (must be new or empty)")
    audit.add_argument("--dataset", default="synthetic", help="any name `equiconvert train` takes (default synthetic)")
    audit.add_argument("--data-dir", default=None)
    audit.add_argument("--num-examples", type=int, default=None, help="use the first N training examples (default all)")
    audit.add_argument("--model", choices=tuple(SMALL_MODELS), default="linear")
    audit.add_argument("--canaries", type=int, default=1000, help="canaries m, each trained on with probability 1/2")
    audit.add_argument("--guesses", type=int, default=100,
                       help="k: the k highest scores are guessed included and the k lowest excluded")
    audit.add_argument("--score", choices=tuple(SCORES), default="gradient",
                       help="gradient: white-box alignment of the weight change with each canary's gradient; "
                            "loss: black-box, minus the trained model's loss")
    audit.add_argument("--confidence", type=float, default=1.0 - DEFAULT_BETA)
    audit.add_argument("--epsilon", type=float, default=None, help=f"default {AUDIT_DEFAULTS['target_epsilon']}")
    audit.add_argument("--delta", type=float, default=None, help="default DPConfig's")
    audit.add_argument("--noise-multiplier", type=float, default=None, help="default: calibrated from --epsilon")
    audit.add_argument("--steps", type=int, default=None, help=f"default {AUDIT_DEFAULTS['steps']}")
    audit.add_argument("--batch-size", type=int, default=None, help=f"default {AUDIT_DEFAULTS['batch_size']}")
    audit.add_argument("--max-grad-norm", type=float, default=None, help=f"default {AUDIT_DEFAULTS['max_grad_norm']}")
    audit.add_argument("--lr", type=float, default=None, help=f"default {AUDIT_DEFAULTS['lr']}")
    audit.add_argument("--seed", type=int, default=0, help="the model's initial weights, the canaries, the coins "
                                                           "that include them and the trainer's seed")
    audit.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    audit.set_defaults(handler=_cmd_audit)


# --- entry point -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="equiconvert", description="Turn CNNs into rotation/reflection-equivariant steerable CNNs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{convert,demo,train}")

    convert = sub.add_parser("convert", help="convert a model and report what changed")
    convert.add_argument("model", help="a registry name (equiconvert.models.list_models()): resnet9, "
                                       "equivariant_resnet9, torchvision:<name>, timm:<name>; bare names: "
                                       "equiconvert's, then torchvision's, then timm's")
    convert.add_argument("--group", required=True, help="C1..C16 (rotations) or D1..D16 (rotations and reflections)")
    convert.add_argument("--input-size", type=int, default=None, help="the image size you will use (H = W)")
    convert.add_argument("--width", type=_width, default=None, metavar="kappa|params|channels|<float>",
                         help="width policy: kappa (1.75, default), params, channels, or a float kappa")
    convert.add_argument("--head", choices=("keep", "invariant"), default=None)
    convert.add_argument("--num-classes", type=int, default=10)
    convert.add_argument("--in-channels", type=int, default=3)
    convert.add_argument("--strict", action="store_true", help="turn equivariance warnings into errors")
    convert.add_argument("--json", action="store_true", help="print one JSON object")
    convert.add_argument("--no-check", action="store_true", help="skip the equivariance check")
    convert.add_argument("--pretrained", nargs="?", const=True, default=False, metavar="WEIGHTS",
                         help="build the model with its pretrained weights (torchvision: optionally a weights name, "
                              "e.g. IMAGENET1K_V1); the report says which layers keep them")
    fit = convert.add_mutually_exclusive_group()
    fit.add_argument("--pad-to-valid", action="store_true",
                     help="an --input-size that breaks exact equivariance is fitted, symmetrically, to the next valid "
                          "size (224 -> 225 for resnet18) in front of the network; without it such a size is an error")
    fit.add_argument("--crop-to-valid", action="store_true",
                     help="as --pad-to-valid, to the previous valid size, by symmetric cropping")
    convert.set_defaults(handler=_cmd_convert)

    _add_demo_parser(sub)
    _add_train_parser(sub)
    _add_audit_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import EquiconvertError

    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --nproc-per-node passes on to its workers
    try:
        return args.handler(args)
    except (CLIError, EquiconvertError, ValueError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
