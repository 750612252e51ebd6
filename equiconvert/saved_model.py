"""Saved models: the weights with the recipe that rebuilds the network, and the library versions.

A file holds plain values and tensors only, so `load` reads it with `torch.load(weights_only=True)` (every file
read is untrusted); the network is rebuilt through the model registry and `make_equivariant` (equiconvert's own
kernel bases: no escnn needed), then the weights are loaded strictly.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._version import __version__
from .errors import DataError, UnreadableFileError
from .untrusted_file import load_weights_only
from .build_recipe import CANONICALIZE, BuildRecipe, is_plain, recipe_of, remember_recipe

FORMAT = "equiconvert-model"
FORMAT_VERSION = 1
VERSIONED_PACKAGES = ("equiconvert", "torch", "escnn", "opacus")
# recipe key: BatchNorm replaced by GroupNorm after building (Opacus' ModuleValidator.fix; the unconverted baseline)
BATCH_NORM_TO_GROUP_NORM = "batch_norm_to_group_norm"


class SavedModelError(DataError, ValueError):
    """A saved model that cannot be written or read back (no recipe, corrupt, unknown format, other weights)."""


def library_versions() -> dict[str, str | None]:
    """Versions of equiconvert, torch, escnn and opacus (None: not installed), for result.json and saved models."""
    versions: dict[str, str | None] = {"equiconvert": __version__, "torch": str(torch.__version__)}
    for package in VERSIONED_PACKAGES[2:]:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def save(model: nn.Module, path: str | Path, recipe: BuildRecipe | None = None) -> Path:
    """Write `model`'s weights and its recipe to `path`, so that `load` rebuilds it without the code that built it.

    Args:
        model: the model to save.
        path: the file to write (its folder is created); written whole or not at all.
        recipe: how to rebuild the model; None takes the one create_model/make_equivariant remembered.

    Returns:
        The path written.

    Raises:
        SavedModelError: the model remembers no recipe and none is given, the recipe is not plain values with a
            'model' registry name, or `path` is a directory.
    """
    recipe = recipe if recipe is not None else recipe_of(model)
    if recipe is None:
        raise SavedModelError(
            f"cannot save {type(model).__name__} to {path}: it does not remember how it was built "
            "(build it with equiconvert.create_model and make_equivariant from plain arguments), "
            "so pass recipe={'model': <registry name>, 'model_kwargs': {...}, 'conversion': {...}}"
        )
    if not is_plain(recipe) or "model" not in recipe:
        raise SavedModelError(f"recipe for {path} must be plain values with a 'model' registry name, got {recipe!r}")
    path = Path(path)
    if path.is_dir():
        raise SavedModelError(f"cannot save to {path}: it is a directory; give a file path such as {path / 'model.pt'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "recipe": recipe,
        "versions": library_versions(),
        "state_dict": {name: value.detach().cpu() for name, value in model.state_dict().items()},
    }
    temporary = path.with_name(path.name + ".tmp")
    try:
        torch.save(state, temporary)
        temporary.replace(path)  # a reader never sees a half-written file
    finally:
        temporary.unlink(missing_ok=True)
    return path


def save_trained(trainer: Any, path: str | Path, batch_norm_to_group_norm: bool = False) -> Path:
    """Write a DPTrainer's final model: the EMA weights when it keeps an EMA (what its evaluations score)."""
    recipe = recipe_of(trainer.model)
    if recipe is not None and batch_norm_to_group_norm:
        recipe = {**recipe, BATCH_NORM_TO_GROUP_NORM: True}
    if trainer.ema is None:
        return save(trainer.model, path, recipe)
    with trainer.ema.applied(trainer.model):
        return save(trainer.model, path, recipe)


def read(path: str | Path) -> dict[str, Any]:
    """The checked contents of a saved model file (weights_only: no code in the file runs)."""
    path = Path(path)
    if path.is_dir():
        raise SavedModelError(
            f"{path} is a directory: give the path of the model file in it (e.g. {path / 'model.pt'})"
        )
    try:
        state = load_weights_only(path, map_location="cpu")
    except UnreadableFileError as error:
        # torch's own text suggests weights_only=False, which would run the file's code: keep it as the cause only
        raise SavedModelError(
            f"{path}: corrupt or not written by equiconvert.save (it is read with weights_only=True and never "
            "unpickled unsafely); re-save it"
        ) from error.__cause__
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise SavedModelError(f"{path} is not an equiconvert model file (written by equiconvert.save?)")
    version = state.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise SavedModelError(
            f"{path} has model format version {version!r}; this equiconvert reads versions up to "
            f"{FORMAT_VERSION}: upgrade equiconvert (the file says it was written by "
            f"{state.get('versions', {}).get('equiconvert')!r})"
        )
    if not isinstance(state.get("recipe"), dict) or not isinstance(state.get("state_dict"), dict):
        raise SavedModelError(f"{path} lacks its recipe or its weights: the file is damaged")
    return state


def rebuild(recipe: BuildRecipe) -> nn.Module:
    """The freshly initialised network `recipe` describes (the global RNG is left as it was)."""
    from .convert import make_equivariant
    from .models import create_model

    with torch.random.fork_rng(devices=[]):
        model = create_model(recipe["model"], **recipe.get("model_kwargs", {}))
        if recipe.get("conversion") is not None:
            conversion = dict(recipe["conversion"])
            model = make_equivariant(model, conversion.pop("group"), **conversion)
        if recipe.get(BATCH_NORM_TO_GROUP_NORM):
            from opacus.validators import ModuleValidator

            model = ModuleValidator.fix(model)
        if recipe.get(CANONICALIZE) is not None:
            from .adapt import canonicalize

            model = canonicalize(model, **recipe[CANONICALIZE])
    return remember_recipe(model, recipe)


def load(path: str | Path) -> nn.Module:
    """The model saved at `path`, rebuilt from its recipe with its saved weights, in eval mode.

    The file is read with torch.load(weights_only=True): no code in it runs.

    Args:
        path: a file written by `save`.

    Returns:
        The rebuilt model, in eval mode.

    Raises:
        FileNotFoundError: there is no file at `path`.
        SavedModelError: `path` is a directory, not a model file of a version this equiconvert reads, damaged, or
            its weights do not fit the network its recipe builds.
    """
    state = read(path)
    model = rebuild(state["recipe"])
    try:
        model.load_state_dict(state["state_dict"], strict=True)
    except RuntimeError as error:
        raise SavedModelError(
            f"the weights in {path} do not fit the network its recipe builds ({error}); was the "
            "file edited, or written by another equiconvert version "
            f"({state.get('versions', {}).get('equiconvert')!r})?"
        ) from error
    return model.eval()
