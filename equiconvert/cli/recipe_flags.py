"""Flags that set recipe keys, shared by `train` and `demo`: their table, parser options, defaults and range checks."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

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
    "--logger": "run.loggers",
}
# the demo's own flags (the rest of the main job is its recipe, changed by --set)
DEMO_FLAGS = {
    "--data-dir": "data.data_dir",
    "--out": "run.out",
    "--device": "run.device",
    "--time-limit": "run.time_limit_s",
    "--threads": "run.threads",
}


def _setting(key: str, value: Any) -> str:
    """How the user gave `key`: its flag and value (the flag alone for a list), else --set KEY=VALUE."""
    shown = f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value) or "''"
    flag = next((flag for flag, flag_key in TRAIN_FLAGS.items() if flag_key == key), None)
    if flag is not None and isinstance(value, (list, tuple)):
        return flag
    return f"{flag} {shown}" if flag else f"--set {key}={shown}"


def check_recipe(recipe: Any) -> tuple[Any, Any]:
    """recipes.recipe_checks.check_recipe (the run's one check, before any data or model is touched), its errors
    naming the flag or --set key the user gave; returns the checked (RunSpec, DPConfig)."""
    from ..recipes.recipe_checks import check_recipe as check

    with _named_settings():
        return check(recipe)


def check_recipe_names(recipe: Any) -> None:
    """recipes.name_checks.check_names (no torch loaded): a mistyped logger is refused before the heavy imports."""
    from ..recipes.name_checks import check_names

    with _named_settings():
        check_names(recipe)


@contextlib.contextmanager
def _named_settings() -> Iterator[None]:
    """A RecipeSettingError as a CLIError naming the flag or --set key the user gave."""
    from ..recipes.name_checks import RecipeSettingError

    try:
        yield
    except RecipeSettingError as exc:
        raise CLIError(f"{_setting(exc.key, exc.value)}: {exc.rule}") from None


def apply_flags(recipe: Any, args: argparse.Namespace, flags: dict[str, str]) -> None:
    """recipe[key] = the value of each flag that was given (the parser leaves out those that were not)."""
    from ..recipes.recipe import set_key

    for flag, key in flags.items():
        dest = flag.removeprefix("--").replace("-", "_")
        if hasattr(args, dest):
            set_key(recipe, key, getattr(args, dest))


def _default_of(key: str, base: Any = None) -> str:
    from ..recipes.recipe import Recipe, recipe_value

    value = recipe_value(base if base is not None else Recipe(), key)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
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
