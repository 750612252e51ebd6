"""`equiconvert demo`: train the main job's recipe, or (`--conversion-only`) convert and check two reference networks."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from .convert import convert_and_check
from .recipe_flags import DEMO_FLAGS, add_recipe_options, apply_flags, check_recipe, recipe_flag
from .commands import SUBCOMMANDS

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
    from ..recipes.recipe import apply_overrides, load_recipe

    recipe = apply_overrides(load_recipe(args.recipe), args.set)
    apply_flags(recipe, args, DEMO_FLAGS)
    if recipe.run.time_limit_s == 0:  # no cap
        recipe.run.time_limit_s = None
    return recipe


def _demo_training(args: argparse.Namespace) -> int:
    """The main job: ResNet9 -> D4, DP-SGD on Fashion-MNIST, as the cpu_main_job recipe says unless flags differ."""
    from ..data import DatasetNotFoundError
    from ..recipes.demo import format_summary, fresh_run, run_main_job

    r = fresh_run(demo_settings(args))
    checked = check_recipe(r)
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
            summary = run_main_job(r, checked)
    except DatasetNotFoundError as exc:
        raise DatasetNotFoundError(
            f"{exc} For the demo: pass --data-dir DIR, or install the Debian package "
            f"dataset-fashion-mnist (sudo apt-get install dataset-fashion-mnist)."
        ) from exc
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


def add_parser(sub) -> None:
    from ..recipes.demo import MAIN_JOB_RECIPE as main_job
    from ..recipes.demo import MAIN_JOB

    demo = sub.add_parser(
        "demo",
        help=SUBCOMMANDS["demo"],
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
    add_recipe_options(demo)
    recipe_flag(
        demo,
        "--data-dir",
        "directory of the Fashion-MNIST IDX .gz files (none: $EQUICONVERT_DATA_DIR, "
        "then /usr/share/datasets/fashion-mnist of the Debian package "
        "dataset-fashion-mnist)",
        main_job,
    )
    recipe_flag(demo, "--out", "output folder (its old results are replaced)", main_job)
    recipe_flag(demo, "--device", "cpu, cuda, cuda:1 (none: cuda if available)", main_job)
    recipe_flag(
        demo, "--time-limit", "training time budget in seconds; 0: none", main_job, type=float, metavar="SECONDS"
    )
    recipe_flag(demo, "--threads", "CPU threads (none: the cores this process may use)", main_job, type=int)
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=_cmd_demo)
