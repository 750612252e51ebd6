"""Flags that set recipe keys, shared by `train` and `demo`: their table, parser options, defaults and range checks."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from .common import CLIError

# `train`'s flags -> the recipe key each sets (everything else: --set KEY=VALUE; `equiconvert recipes` shows keys)
TRAIN_FLAGS = {
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
DEMO_FLAGS = {
    "--data-dir": "data.data_dir",
    "--out": "run.out",
    "--device": "run.device",
    "--time-limit": "run.time_limit_s",
    "--threads": "run.threads",
}

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
    from ..recipes.recipe import ALIASES, attribute_path

    target = recipe
    for part in attribute_path(ALIASES.get(key, key)).split("."):
        target = getattr(target, part)
    return target


def check_recipe(recipe: Any) -> None:
    """Every numeric setting in range, and the data set known, before any data or model is touched."""
    from ..data import resolve_name

    flags = {key: flag for flag, key in TRAIN_FLAGS.items()}
    for key, (valid, rule) in _RECIPE_LIMITS.items():
        value = _value(recipe, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not valid(value):
            raise CLIError(f"{flags[key]} {value:g}: {rule}" if key in flags else f"--set {key}={value:g}: {rule}")
    if recipe.data.dataset is not None:
        resolve_name(recipe.data.dataset)


def apply_flags(recipe: Any, args: argparse.Namespace, flags: dict[str, str]) -> None:
    """recipe[key] = the value of each flag that was given (the parser leaves out those that were not)."""
    from ..recipes.recipe import set_key

    for flag, key in flags.items():
        dest = flag.removeprefix("--").replace("-", "_")
        if hasattr(args, dest):
            set_key(recipe, key, getattr(args, dest))


def _default_of(key: str, base: Any = None) -> str:
    from ..recipes.recipe import Recipe

    value = _value(base if base is not None else Recipe(), key)
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def recipe_flag(group, flag: str, help: str, base: Any = None, **kwargs: Any) -> None:
    """A flag that sets one recipe key: no parser default (`base`, else the recipe dataclasses, hold it), which its
    help shows."""
    key = TRAIN_FLAGS.get(flag) or DEMO_FLAGS[flag]
    group.add_argument(
        flag, default=argparse.SUPPRESS, help=f"{help} [{key}; default: {_default_of(key, base)}]", **kwargs
    )


def add_recipe_options(group) -> None:
    """`--set KEY=VALUE`, repeatable: any recipe key, applied after the flags."""
    group.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any recipe key, e.g. dp.epsilon=2, schedule.lr_schedule=cosine, "
        "model.kwargs.norm_groups=4 (VALUE read as TOML: 2, 1e-5, true, [8, 16]); repeatable, "
        "applied last; `equiconvert recipes` lists the recipes, an unknown key lists the keys [default: none]",
    )
