"""The one check of a run description: a recipe becomes a (RunSpec, DPConfig) pair here or is refused.

Everything a run reads from its recipe is checked before any data or model is touched, in one place, against the
trainer's limits (training.dp_config) and the run's own (RUN_LIMITS). An error names the recipe key, so a front
end (the command line) can show its own name for the setting: its flag.
"""

from __future__ import annotations

from typing import Callable

from ..data import resolve_name
from ..training.devices import resolve_device
from ..training.dp_config import OFF_OPTIONS, ConfigError, DPConfig, check_config
from ..training.run_folder import EMPTY_OUT_RULE, names_no_folder
from .adapt_model import refuse_bad_adaptation
from .build_model import refuse_conversion_options_for_baseline, refuse_preset_options_for_other_models
from .name_checks import RecipeSettingError, check_names
from .recipe import Recipe, recipe_value, trainer_fields
from .run_spec import RunSpec, spec_of, trainer_config

# the run's own settings, each with its test and the error's rule (the trainer's: training.dp_config)
RUN_LIMITS: dict[str, tuple[Callable[[float], bool], str]] = {
    "run.time_limit_s": (lambda v: v > 0, "must be > 0 seconds"),
    "run.threads": (lambda v: v >= 1, "give at least 1 CPU thread"),
}


def check_recipe(recipe: Recipe) -> tuple[RunSpec, DPConfig]:
    """The run the recipe describes, checked whole before any data or model is touched.

    Args:
        recipe: the run's description (recipes.recipe.load_recipe, then any overrides).

    Returns:
        The run's RunSpec and its trainer's DPConfig (a recipe's 0 read as off), for runner.run_checked.

    Raises:
        RecipeSettingError: a setting out of range, naming its recipe key, value and rule.
        RecipeError: data.dataset or run.out not set.
        UsageError: an unknown data set, a device this machine lacks, an option the model cannot take.
    """
    config = trainer_config(recipe)
    try:
        check_config(config)
    except ConfigError as exc:
        key = next(key for key, name in trainer_fields().items() if name == exc.field)
        off = f" (0: {OFF_OPTIONS[exc.field]})" if exc.field in OFF_OPTIONS else ""
        raise RecipeSettingError(key, exc.value, f"{exc.rule}{off}") from None
    for key, (valid, rule) in RUN_LIMITS.items():
        value = recipe_value(recipe, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not valid(value):
            raise RecipeSettingError(key, value, rule)
    check_names(recipe)
    if names_no_folder(recipe.run.out):
        raise RecipeSettingError("run.out", recipe.run.out, EMPTY_OUT_RULE)
    dataset = resolve_name(recipe.data.dataset) if recipe.data.dataset is not None else None
    if dataset == "synthetic" and recipe.data.data_dir is not None:
        raise RecipeSettingError(
            "data.data_dir", recipe.data.data_dir, "the synthetic data set is generated, not read; drop it"
        )
    resolve_device(recipe.run.device)
    spec = spec_of(recipe)
    refuse_bad_adaptation(spec)
    refuse_conversion_options_for_baseline(spec)
    refuse_preset_options_for_other_models(spec)
    return spec, config
