"""Command line: `equiconvert convert MODEL --group D4 ...`, `train`, `recipes`, `demo` and `audit`.

`convert` builds a model by its registry name (equiconvert.models.create_model), converts it,
measures its equivariance error at a valid input size and prints the conversion
report (readable, or one JSON object with --json). `demo` is the package's main
job (equiconvert.recipes.demo): ResNet9 converted to D4 and trained with DP-SGD on
Fashion-MNIST; `demo --conversion-only` converts and checks two reference networks. `train` runs a
recipe (equiconvert.recipes), changed by its flags and `--set KEY=VALUE`; the layering is
cli -> recipes -> library.

User errors (unknown model, group, width, a model that cannot be converted) print
one `error: ...` line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
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
            raise CLIError(
                f"{model_spec} is built equivariant: --pretrained, --pad-to-valid and --crop-to-valid "
                "apply to converted models only"
            )
        start = time.perf_counter()
        converted = create_model(model_spec, group=group, num_classes=num_classes, in_channels=in_channels, **options)
    else:
        model = create_model(
            model_spec, num_classes=num_classes, in_channels=in_channels, pretrained=pretrained or None
        )
        start = time.perf_counter()
        converted = make_equivariant(
            model, spec, pretrained=bool(pretrained), pad_to_valid=pad_to_valid, crop_to_valid=crop_to_valid, **options
        )
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
            args.model,
            args.group,
            input_size=args.input_size,
            width=args.width,
            head=args.head,
            num_classes=args.num_classes,
            in_channels=args.in_channels,
            strict=args.strict,
            check=not args.no_check,
            pretrained=args.pretrained,
            pad_to_valid=args.pad_to_valid,
            crop_to_valid=args.crop_to_valid,
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
        models.append(
            {
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
            }
        )
    return {"group": group, "models": models, "total_time_s": round(time.perf_counter() - start, 3)}


def _print_demo(summary: dict) -> None:
    for m in summary["models"]:
        print(f"== {m['model']} -> {m['group']} (width {m['width']})")
        print(f"  parameters: {m['params_before']:,} -> {m['params_after']:,}")
        print(f"  valid input sizes: {m['valid_input_rule']}")
        print(
            f"  layers swapped: {m['layers_swapped']} (+{m['layers_inserted']} inserted); "
            f"output {'invariant' if m['invariant_output'] else 'NOT invariant'}"
        )
        print(f"  warnings: {len(m['warnings'])}")
        for warning in m["warnings"]:
            print(f"    {warning}")
        print(
            f"  max equivariance error at {m['check_input_size']}x{m['check_input_size']}: "
            f"{m['max_equivariance_error']:.2e}"
        )
        print(f"  time: conversion {m['conversion_time_s']:.2f} s, check {m['check_time_s']:.2f} s")
    print(f"total wall time: {summary['total_time_s']:.1f} s")


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.conversion_only:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            summary = run_demo(demo_settings(args).conversion.group)
        if args.json:
            print(json.dumps(summary))
        else:
            _print_demo(summary)
        return 0
    return _demo_training(args)


def demo_settings(args: argparse.Namespace):
    """The main job's recipe (cpu_main_job) with the demo's flags and --set overrides (`--time-limit 0`: no cap)."""
    from .recipes.recipe import apply_overrides, load_recipe

    recipe = apply_overrides(load_recipe(args.recipe), args.set)
    _apply_flags(recipe, args, _DEMO_FLAGS)
    if recipe.run.time_limit_s == 0:  # no cap
        recipe.run.time_limit_s = None
    return recipe


def _demo_training(args: argparse.Namespace) -> int:
    """The main job: ResNet9 -> D4, DP-SGD on Fashion-MNIST, as the cpu_main_job recipe says unless flags differ."""
    from .data import DatasetNotFoundError
    from .recipes.demo import format_summary, run_main_job

    r = demo_settings(args)
    _check_recipe(r)
    if not args.json:
        t = r.trainer
        cap = f"training capped at {r.run.time_limit_s:.0f} s" if r.run.time_limit_s else "no time cap"
        widths = r.model.kwargs.get("widths")
        print(
            f"equiconvert demo: {r.model.name}"
            + (f" (widths {','.join(map(str, widths))})" if widths else "")
            + f" -> {r.conversion.group}, DP-SGD on {r.data.dataset}, epsilon {t.target_epsilon:g}, delta "
            f"{t.delta:g}, up to {t.steps} steps of batch {t.batch_size} ({cap}); output in {r.run.out}",
            flush=True,
        )
    try:
        with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
            summary = run_main_job(r)
    except DatasetNotFoundError as exc:
        raise CLIError(
            f"{exc} For the demo: pass --data-dir DIR, or install the Debian package "
            f"dataset-fashion-mnist (sudo apt-get install dataset-fashion-mnist)."
        ) from exc
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


# recipe keys whose values are checked before any data or model is loaded: each with its test and the error's rule
_RECIPE_LIMITS: dict[str, tuple[Callable[[float], bool], str]] = {
    "dp.target_epsilon": (lambda v: v > 0, "must be > 0"),
    "dp.delta": (lambda v: 0 < v < 1, "must be in (0, 1)"),
    "dp.noise_multiplier": (lambda v: v > 0, "must be > 0"),
    "dp.batch_size": (lambda v: v >= 1, "must be >= 1"),
    "dp.physical_batch_size": (lambda v: v >= 1, "must be >= 1"),
    "schedule.steps": (lambda v: v >= 1, "must be >= 1"),
    "dp.aug_mult": (lambda v: v >= 1, "must be >= 1"),
    "dp.max_grad_norm": (lambda v: v > 0, "must be > 0"),
    "schedule.lr": (lambda v: v > 0, "must be > 0"),
    "schedule.momentum": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "data.augment_padding": (lambda v: v >= 0, "must be >= 0"),
    "data.normalize_std": (lambda v: v > 0, "must be > 0"),
    "schedule.ema_decay": (lambda v: 0 <= v < 1, "must be in [0, 1) (0: no EMA)"),
    "schedule.eval_every": (lambda v: v >= 1, "must be >= 1"),
    "schedule.checkpoint_every": (lambda v: v >= 0, "must be >= 0 (0: none)"),
    "run.time_limit_s": (lambda v: v > 0, "must be > 0 seconds"),
    "run.threads": (lambda v: v >= 1, "give at least 1 CPU thread"),
}


def _value(recipe: Any, key: str) -> Any:
    from .recipes.recipe import ALIASES, attribute_path

    target = recipe
    for part in attribute_path(ALIASES.get(key, key)).split("."):
        target = getattr(target, part)
    return target


def _check_recipe(recipe: Any) -> None:
    """Every numeric setting in range, and the data set known, before any data or model is touched."""
    from .data import resolve_name

    flags = {key: flag for flag, key in _TRAIN_FLAGS.items()}
    for key, (valid, rule) in _RECIPE_LIMITS.items():
        value = _value(recipe, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not valid(value):
            raise CLIError(f"{flags[key]} {value:g}: {rule}" if key in flags else f"--set {key}={value:g}: {rule}")
    if recipe.data.dataset is not None:
        resolve_name(recipe.data.dataset)


def train_recipe(args: argparse.Namespace):
    """The recipe `train` runs: --recipe (or the defaults), then the flags given, then --model-kwargs and --set."""
    from .recipes.recipe import Recipe, apply_overrides, load_recipe

    recipe = load_recipe(args.recipe) if getattr(args, "recipe", None) else Recipe()
    _apply_flags(recipe, args, _TRAIN_FLAGS)
    recipe.model.kwargs.update(getattr(args, "model_kwargs", {}))
    return apply_overrides(recipe, getattr(args, "set", []))


def _apply_flags(recipe: Any, args: argparse.Namespace, flags: dict[str, str]) -> None:
    """recipe[key] = the value of each flag that was given (the parser leaves out those that were not)."""
    from .recipes.recipe import set_key

    for flag, key in flags.items():
        dest = flag.removeprefix("--").replace("-", "_")
        if hasattr(args, dest):
            set_key(recipe, key, getattr(args, dest))


def _cmd_train(args: argparse.Namespace) -> int:
    from .recipes.runner import run_recipe

    recipe = train_recipe(args)
    _check_recipe(recipe)
    if getattr(args, "nproc_per_node", None) is not None:
        return _launch_train(args)
    if recipe.run.threads is not None:
        torch.set_num_threads(recipe.run.threads)
    result = run_recipe(recipe)
    if os.environ.get("RANK", "0") == "0":  # one printout per job (torchrun numbers its workers in RANK)
        print(json.dumps(result, indent=2))
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from .recipes.recipe import recipe_text, shipped_recipes

    if args.name:
        print(recipe_text(args.name)[0], end="")
        return 0
    for name, about in shipped_recipes().items():
        print(f"{name}: {about}")
    print("run one: equiconvert train --recipe NAME [--set KEY=VALUE ...]; show one: equiconvert recipes NAME")
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


# `train`'s flags -> the recipe key each sets (everything else: --set KEY=VALUE; `equiconvert recipes` shows keys)
_TRAIN_FLAGS = {
    "--model": "model.name",
    "--group": "conversion.group",
    "--dataset": "data.dataset",
    "--data-dir": "data.data_dir",
    "--epsilon": "dp.target_epsilon",
    "--delta": "dp.delta",
    "--accountant": "dp.accountant",
    "--batch-size": "dp.batch_size",
    "--aug-mult": "dp.aug_mult",
    "--max-grad-norm": "dp.max_grad_norm",
    "--steps": "schedule.steps",
    "--lr": "schedule.lr",
    "--seed": "schedule.seed",
    "--physical-batch-size": "dp.physical_batch_size",
    "--insecure-seeded-noise": "dp.insecure_seeded_noise",
    "--out": "run.out",
    "--device": "run.device",
    "--time-limit": "run.time_limit_s",
    "--resume": "run.resume",
    "--overwrite": "run.overwrite",
    "--threads": "run.threads",
}
# the demo's own flags (the rest of the main job is its recipe, changed by --set)
_DEMO_FLAGS = {
    "--data-dir": "data.data_dir",
    "--out": "run.out",
    "--device": "run.device",
    "--time-limit": "run.time_limit_s",
    "--threads": "run.threads",
}


def _default_of(key: str, base: Any = None) -> str:
    from .recipes.recipe import Recipe

    value = _value(base if base is not None else Recipe(), key)
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _recipe_flag(group, flag: str, help: str, base: Any = None, **kwargs: Any) -> None:
    """A flag that sets one recipe key: no parser default (`base`, else the recipe dataclasses, hold it), which its
    help shows."""
    key = _TRAIN_FLAGS.get(flag) or _DEMO_FLAGS[flag]
    group.add_argument(
        flag, default=argparse.SUPPRESS, help=f"{help} [{key}; default: {_default_of(key, base)}]", **kwargs
    )


def _add_recipe_options(group) -> None:
    group.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any recipe key, e.g. dp.epsilon=2, schedule.lr_schedule=cosine, "
        "model.kwargs.norm_groups=4 (VALUE read as TOML: 2, 1e-5, true, [8, 16]); repeatable, "
        "applied last; `equiconvert recipes` lists the recipes, an unknown key lists the keys [default: none]",
    )


def _add_train_parser(sub) -> None:
    from .recipes.recipe import parse_kwargs

    train = sub.add_parser(
        "train",
        help="train a (converted) model with DP-SGD and write OUT/result.json",
        description="Train as a recipe says (equiconvert/recipes/files/*.toml, or your own TOML file), changed by "
        "the flags given and then by --set KEY=VALUE. Defaults: privacy.trainer.DPConfig and the recipe "
        "dataclasses (equiconvert.recipes.recipe).",
    )
    g = train.add_argument_group("model")
    _recipe_flag(
        g,
        "--model",
        "a registry name (equiconvert.models.list_models()): resnet9, equivariant_resnet9 "
        "(Hölzl et al.'s model for --group), torchvision:<name>, timm:<name>",
    )
    g.add_argument(
        "--model-kwargs",
        type=_model_kwargs(parse_kwargs),
        default=argparse.SUPPRESS,
        metavar="K=V,...",
        help="the model's keyword arguments, e.g. widths=16,32,64 (equiconvert:resnet9) or "
        "activation=relu,norm_groups=4,res2=false,pool_after_res2=true (equivariant_resnet9); "
        "a model that does not take one refuses it [model.kwargs; default: the model's own]",
    )
    _recipe_flag(
        g,
        "--group",
        "C1..C16, D1..D16, or 'none' for the unconverted baseline (conversion.width/head/init_gain: --set)",
    )
    g = train.add_argument_group("data")
    _recipe_flag(
        g,
        "--dataset",
        "fashion-mnist, cifar10, rotated-mnist, imagenet32, imagefolder, synthetic (required, by the recipe or here)",
    )
    _recipe_flag(g, "--data-dir", "the data set's folder")
    g = train.add_argument_group("privacy")
    _recipe_flag(g, "--epsilon", "target epsilon (the noise is calibrated to spend it)", type=float)
    _recipe_flag(
        g, "--delta", "none: 1e-5 while 1e-5 <= 1/(10 N), else the largest power of ten <= 1/(10 N)", type=float
    )
    _recipe_flag(g, "--accountant", "privacy accountant", choices=("rdp", "prv"))
    _recipe_flag(g, "--batch-size", "expected logical (Poisson) batch size", type=int)
    _recipe_flag(g, "--aug-mult", "augmented views per example, averaged before clipping", type=int)
    _recipe_flag(g, "--max-grad-norm", "per-example clipping norm", type=float)
    g = train.add_argument_group("optimisation")
    _recipe_flag(g, "--steps", "DP-SGD steps", type=int)
    _recipe_flag(
        g, "--lr", "learning rate (schedule.lr_schedule, .momentum, .optimizer, .ema_decay: --set)", type=float
    )
    g = train.add_argument_group("run and output")
    g.add_argument(
        "--recipe",
        default=argparse.SUPPRESS,
        metavar="NAME|FILE",
        help="a shipped recipe's name (equiconvert recipes) or a TOML file [default: none, the defaults]",
    )
    _add_recipe_options(g)
    _recipe_flag(g, "--out", "output folder (log.jsonl, checkpoint.pt, result.json); required, by the recipe or here")
    _recipe_flag(g, "--device", "cpu, cuda, cuda:1 (none: cuda if available)")
    _recipe_flag(
        g,
        "--time-limit",
        "stop training after this many seconds, with a checkpoint; --resume continues",
        type=float,
        metavar="SECONDS",
    )
    _recipe_flag(g, "--resume", "continue from OUT/checkpoint.pt (which must exist)", action="store_true")
    _recipe_flag(
        g, "--overwrite", "replace the earlier run in OUT (a non-empty OUT is refused otherwise)", action="store_true"
    )
    g = train.add_argument_group("advanced")
    _recipe_flag(g, "--physical-batch-size", "examples per forward/backward pass (memory, not privacy)", type=int)
    _recipe_flag(g, "--seed", "initial weights, augmentation and data order (never the DP noise or sampling)", type=int)
    _recipe_flag(g, "--threads", "CPU threads of this process (none: PyTorch's, one per core)", type=int)
    _recipe_flag(
        g,
        "--insecure-seeded-noise",
        "NOT PRIVATE: seed the DP noise and batch sampling from --seed (tests, "
        "debugging); result.json records private: false",
        action="store_true",
    )
    g.add_argument(
        "--nproc-per-node",
        type=int,
        default=argparse.SUPPRESS,
        metavar="N",
        help="train on N local processes (GPUs) at once, as torchrun --standalone --nproc-per-node N "
        "would (docs/multi-gpu.md) [default: one process]",
    )
    train.set_defaults(handler=_cmd_train)

    recipes = sub.add_parser("recipes", help="list the shipped recipes, or print one")
    recipes.add_argument("name", nargs="?", help="print this recipe's TOML")
    recipes.set_defaults(handler=_cmd_recipes)


def _model_kwargs(parse: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    def parse_flag(text: str) -> dict[str, Any]:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse_flag


def _add_demo_parser(sub) -> None:
    from .recipes.demo import CPU_DEFAULTS as main_job
    from .recipes.demo import MAIN_JOB

    demo = sub.add_parser(
        "demo",
        help="the main job: convert ResNet9 to D4 and train it with DP-SGD on Fashion-MNIST",
        description="Train the cpu_main_job recipe (equiconvert recipes cpu_main_job): ResNet9 converted to D4, "
        "DP-SGD on Fashion-MNIST (Poisson sampling, RDP accounting); a timing probe plans the steps "
        "that fit --time-limit before the noise is calibrated, so the whole epsilon is spent. Prints and "
        "writes OUT/demo.json: test accuracy, epsilon/delta, parameters, equivariance error, wall time.",
    )
    demo.add_argument(
        "--conversion-only",
        action="store_true",
        help="only convert and check torchvision resnet18 and equiconvert resnet9 (no training)",
    )
    demo.add_argument(
        "--recipe", default=MAIN_JOB, metavar="NAME|FILE", help=f"the recipe the demo trains (default: {MAIN_JOB})"
    )
    _add_recipe_options(demo)
    _recipe_flag(
        demo,
        "--data-dir",
        "directory of the Fashion-MNIST IDX .gz files (none: $EQUICONVERT_DATA_DIR, "
        "then /usr/share/datasets/fashion-mnist of the Debian package "
        "dataset-fashion-mnist)",
        main_job,
    )
    _recipe_flag(demo, "--out", "output folder (its old results are replaced)", main_job)
    _recipe_flag(demo, "--device", "cpu, cuda, cuda:1 (none: cuda if available)", main_job)
    _recipe_flag(
        demo, "--time-limit", "training time budget in seconds; 0: none", main_job, type=float, metavar="SECONDS"
    )
    _recipe_flag(demo, "--threads", "CPU threads (none: the cores this process may use)", main_job, type=int)
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
        images, labels = images[: args.num_examples], labels[: args.num_examples]
    torch.manual_seed(args.seed)  # the model's initial weights
    model = SMALL_MODELS[args.model](data.image_shape, data.num_classes)
    canaries = make_canaries(data.image_shape, data.num_classes, args.canaries, seed=args.seed + 1)
    given = {
        "target_epsilon": args.epsilon,
        "delta": args.delta,
        "noise_multiplier": args.noise_multiplier,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "max_grad_norm": args.max_grad_norm,
        "lr": args.lr,
        "seed": args.seed,
    }
    options = {**AUDIT_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    if args.noise_multiplier is not None and args.epsilon is None:  # a fixed sigma: no budget to stop at
        options["target_epsilon"] = None
    result = run_audit(
        model,
        (images, labels),
        canaries,
        guesses_included=args.guesses,
        guesses_excluded=args.guesses,
        score=args.score,
        beta=1.0 - args.confidence,
        inclusion_seed=args.seed,
        device=args.device,
        **options,
    )
    record = json.dumps(result.to_dict(), indent=2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(record + "\n")
    print(record)
    return 0


def _add_audit_parser(sub) -> None:
    from .privacy.audit import AUDIT_DEFAULTS, DEFAULT_BETA, SCORES, SMALL_MODELS

    audit = sub.add_parser(
        "audit",
        help="empirical lower bound on epsilon from one DP-SGD run with canaries",
        description="Train a small model once with DP-SGD on DATASET plus a random half of --canaries random-pixel, "
        "random-label canaries, guess which canaries were trained on, and turn the correct guesses into "
        "a lower bound on epsilon (Steinke, Nasr, Jagielski 2023), printed beside the accountant's "
        "epsilon and written to OUT/audit.json.",
    )
    audit.add_argument("--out", required=True, help="output folder for audit.json (must be new or empty)")
    audit.add_argument("--dataset", default="synthetic", help="any name `equiconvert train` takes (default synthetic)")
    audit.add_argument("--data-dir", default=None)
    audit.add_argument("--num-examples", type=int, default=None, help="use the first N training examples (default all)")
    audit.add_argument("--model", choices=tuple(SMALL_MODELS), default="linear")
    audit.add_argument("--canaries", type=int, default=1000, help="canaries m, each trained on with probability 1/2")
    audit.add_argument(
        "--guesses",
        type=int,
        default=100,
        help="k: the k highest scores are guessed included and the k lowest excluded",
    )
    audit.add_argument(
        "--score",
        choices=tuple(SCORES),
        default="gradient",
        help="gradient: white-box alignment of the weight change with each canary's gradient; "
        "loss: black-box, minus the trained model's loss",
    )
    audit.add_argument("--confidence", type=float, default=1.0 - DEFAULT_BETA)
    audit.add_argument("--epsilon", type=float, default=None, help=f"default {AUDIT_DEFAULTS['target_epsilon']}")
    audit.add_argument("--delta", type=float, default=None, help="default DPConfig's")
    audit.add_argument("--noise-multiplier", type=float, default=None, help="default: calibrated from --epsilon")
    audit.add_argument("--steps", type=int, default=None, help=f"default {AUDIT_DEFAULTS['steps']}")
    audit.add_argument("--batch-size", type=int, default=None, help=f"default {AUDIT_DEFAULTS['batch_size']}")
    audit.add_argument("--max-grad-norm", type=float, default=None, help=f"default {AUDIT_DEFAULTS['max_grad_norm']}")
    audit.add_argument("--lr", type=float, default=None, help=f"default {AUDIT_DEFAULTS['lr']}")
    audit.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the model's initial weights, the canaries, the coins that include them and the trainer's seed",
    )
    audit.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    audit.set_defaults(handler=_cmd_audit)


# --- entry point -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="equiconvert", description="Turn CNNs into rotation/reflection-equivariant steerable CNNs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{convert,demo,train,recipes,audit}")

    convert = sub.add_parser("convert", help="convert a model and report what changed")
    convert.add_argument(
        "model",
        help="a registry name (equiconvert.models.list_models()): resnet9, "
        "equivariant_resnet9, torchvision:<name>, timm:<name>; bare names: "
        "equiconvert's, then torchvision's, then timm's",
    )
    convert.add_argument("--group", required=True, help="C1..C16 (rotations) or D1..D16 (rotations and reflections)")
    convert.add_argument("--input-size", type=int, default=None, help="the image size you will use (H = W)")
    convert.add_argument(
        "--width",
        type=_width,
        default=None,
        metavar="kappa|params|channels|<float>",
        help="width policy: kappa (1.75, default), params, channels, or a float kappa",
    )
    convert.add_argument("--head", choices=("keep", "invariant"), default=None)
    convert.add_argument("--num-classes", type=int, default=10)
    convert.add_argument("--in-channels", type=int, default=3)
    convert.add_argument("--strict", action="store_true", help="turn equivariance warnings into errors")
    convert.add_argument("--json", action="store_true", help="print one JSON object")
    convert.add_argument("--no-check", action="store_true", help="skip the equivariance check")
    convert.add_argument(
        "--pretrained",
        nargs="?",
        const=True,
        default=False,
        metavar="WEIGHTS",
        help="build the model with its pretrained weights (torchvision: optionally a weights name, "
        "e.g. IMAGENET1K_V1); the report says which layers keep them",
    )
    fit = convert.add_mutually_exclusive_group()
    fit.add_argument(
        "--pad-to-valid",
        action="store_true",
        help="an --input-size that breaks exact equivariance is fitted, symmetrically, to the next valid "
        "size (224 -> 225 for resnet18) in front of the network; without it such a size is an error",
    )
    fit.add_argument(
        "--crop-to-valid",
        action="store_true",
        help="as --pad-to-valid, to the previous valid size, by symmetric cropping",
    )
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
