"""The checks of a recipe that need no torch (its logger names), so that a mistyped name is refused at once.

recipe_checks.check_recipe runs them as part of the run's one check; the command line runs them first, before it
loads torch, the data sets and the models (seconds of start-up a typo should not cost).
"""

from __future__ import annotations

from typing import Any

from ..training.loggers import LoggerError, check_loggers
from .recipe import Recipe, RecipeError


class RecipeSettingError(RecipeError):
    """A recipe key whose value cannot run; key, value and rule let a front end name the setting its own way."""

    def __init__(self, key: str, value: Any, rule: str) -> None:
        self.key, self.value, self.rule = key, value, rule
        super().__init__(f"{key}={value!r}: {rule}")


def check_names(recipe: Recipe) -> None:
    """Refuse an unknown logger name (or one whose package is missing), naming the recipe key."""
    try:
        check_loggers(recipe.run.loggers, parameter="run.loggers")
    except LoggerError as exc:
        raise RecipeSettingError("run.loggers", recipe.run.loggers, str(exc).removeprefix("run.loggers: ")) from None
