"""How a model was built (registry name, keyword arguments, conversion), remembered on the model itself.

`create_model` and `make_equivariant` attach the recipe; `equiconvert.save` writes it next to the weights and
`equiconvert.load` replays it. Only plain values (numbers, strings, lists, dicts, None) are kept, so a recipe
loads with `torch.load(weights_only=True)`; a model built from anything else (a callable width, a module
class) has no recipe and must be saved with an explicit one. (A training run's recipe, read from TOML, is
equiconvert.recipes.recipe.Recipe.)
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any

from torch import nn

RECIPE_ATTRIBUTE = "equiconvert_recipe"
BuildRecipe = dict[str, Any]
# arguments that only matter while building: the saved weights replace them
BUILD_ONLY_ARGUMENTS = ("pretrained", "weights")
CANONICALIZE = "canonicalize"  # the recipe's key for adapt.canonicalize's arguments, applied last


def is_plain(value: Any) -> bool:
    """Whether `value` is made of None, bools, numbers, strings, lists, tuples and str-keyed dicts only."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and is_plain(item) for key, item in value.items())
    return False


def remember_recipe(model: nn.Module, recipe: BuildRecipe | None) -> nn.Module:
    """Attach `recipe` to `model` when it is plain (else none: the model cannot be rebuilt from it)."""
    setattr(model, RECIPE_ATTRIBUTE, recipe if recipe is not None and is_plain(recipe) else None)
    return model


def recipe_of(model: nn.Module) -> BuildRecipe | None:
    return getattr(model, RECIPE_ATTRIBUTE, None)


def registry_recipe(name: str, kwargs: dict[str, Any]) -> BuildRecipe:
    """The recipe of create_model(name, **kwargs)."""
    return {"model": name, "model_kwargs": {k: v for k, v in kwargs.items() if k not in BUILD_ONLY_ARGUMENTS}}


def conversion_recipe(source: nn.Module, arguments: dict[str, Any]) -> BuildRecipe | None:
    """The recipe of make_equivariant(source, **arguments): the source's recipe plus the conversion's arguments."""
    built = recipe_of(source)
    if built is None:
        return None
    arguments = {
        key: asdict(value) if is_dataclass(value) else value
        for key, value in arguments.items()
        if key not in BUILD_ONLY_ARGUMENTS
    }
    return {**built, "conversion": arguments}
