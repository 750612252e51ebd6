"""Typed experiment recipes: what one `equiconvert train` run does, loadable from TOML and overridable by dotted keys.

A recipe has these sections: [model] (registry name and keyword arguments), [conversion] (group and the
conversion's options), [adapt] (pretrained weights and how they are kept), [dp], [schedule] and [data] (the fields
of training.dp_config.DPConfig, grouped by what they set; [data] also names the data set), and [run] (output
folder, device, time limit). DPConfig and the dataclasses below are the one source of
every default: the command line fills only what it was given.
"""

from __future__ import annotations

import copy
import re
import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..training.dp_config import DPConfig
from ..training.loggers import DEFAULT_LOGGERS
from .value_types import describe, matches

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

RECIPE_DIR = "files"
NO_ADAPTATION = "none"  # adapt.method: a model built afresh, or pretrained weights trained as they are


class RecipeError(UsageError, ValueError):
    """A recipe file or a --set override that cannot be applied; the message names the key or file."""


@dataclass
class ModelOptions:
    """The model, by registry name (equiconvert.models.list_models()), and the keyword arguments it is built with."""

    name: str = "equiconvert:resnet9"
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class ConversionOptions:
    """The symmetry group ("none": the unconverted baseline) and the conversion's options (None: the model's own)."""

    group: str = "D4"
    width: str | float | None = None
    head: str | None = None
    init_gain: float | None = None
    pad_to_valid: bool = False  # fit the images' size inside the model (make_equivariant's pad_to_valid)


@dataclass
class DataOptions:
    """The data set (any name equiconvert.data resolves) and its folder (None: the data set's default places);
    classes keeps only the examples of these labels, in both splits (the model keeps every class's logit)."""

    dataset: str | None = None
    data_dir: str | None = None
    classes: tuple[int, ...] | None = None


@dataclass
class AdaptOptions:
    """Pretrained weights and how the run keeps them (recipes.adapt_model.ADAPT_METHODS).

    weights is a state-dict file of the model as [model] builds it, read with weights_only=True. The public data set
    (public_* keys) must hold no private example: canonicalize teaches its canonicaliser the upright pose on it
    (pose_steps Adam steps, no privacy spent), carry_weights measures its logit error on it.
    """

    method: str = NO_ADAPTATION
    weights: str | None = None
    prior_weight: float = 0.5  # canonicalize: pose_prior_loss's weight
    canonicalizer_pool: int | None = None  # canonicalize: average pooling of the canonicaliser's input (None: its own)
    public_dataset: str | None = None
    public_data_dir: str | None = None
    public_classes: tuple[int, ...] | None = None
    pose_steps: int = 2000


@dataclass
class RunOptions:
    """Where and how long the run goes: out is required (by the recipe or --out)."""

    out: str | None = None
    device: str | None = None  # None: cuda if available, else cpu
    threads: int | None = None  # None: PyTorch's own
    time_limit_s: float | None = None  # stop (with a checkpoint) after this much training time
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    plan_steps: bool = False  # fit the steps to time_limit_s by a timing probe before the noise is calibrated
    loggers: tuple[str, ...] = DEFAULT_LOGGERS  # names in training.loggers.LOGGERS; log.jsonl is always written


@dataclass
class Recipe:
    """One training run: model, conversion, DP-SGD options (a DPConfig) and run options."""

    model: ModelOptions = field(default_factory=ModelOptions)
    conversion: ConversionOptions = field(default_factory=ConversionOptions)
    data: DataOptions = field(default_factory=DataOptions)
    adapt: AdaptOptions = field(default_factory=AdaptOptions)
    trainer: DPConfig = field(default_factory=DPConfig)
    run: RunOptions = field(default_factory=RunOptions)


# DPConfig's fields by the recipe section that holds them ([dp] takes every field no other section names)
_SCHEDULE = (
    "steps",
    "lr",
    "lr_schedule",
    "momentum",
    "optimizer",
    "ema_decay",
    "eval_every",
    "eval_batch_size",
    "checkpoint_every",
    "epsilon_every",
    "seed",
)
_DATA = ("augment_padding", "augment_flip", "normalize_mean", "normalize_std", "test_shifts")
ALIASES = {"dp.epsilon": "dp.target_epsilon"}  # the name every flag and paper uses


def _trainer_section(name: str) -> str:
    return "schedule" if name in _SCHEDULE else "data" if name in _DATA else "dp"


def trainer_fields() -> dict[str, str]:
    """Dotted recipe key -> DPConfig field, for every DPConfig field."""
    return {f"{_trainer_section(f.name)}.{f.name}": f.name for f in dataclasses.fields(DPConfig)}


def _section_fields() -> dict[str, str]:
    """Dotted key -> attribute path on Recipe for every settable key but model.kwargs.*."""
    keys = {}
    for section, cls in (
        ("model", ModelOptions),
        ("conversion", ConversionOptions),
        ("data", DataOptions),
        ("adapt", AdaptOptions),
        ("run", RunOptions),
    ):
        for f in dataclasses.fields(cls):
            keys[f"{section}.{f.name}"] = f"{section}.{f.name}"
    for key, name in trainer_fields().items():
        keys[key] = f"trainer.{name}"
    return keys


def attribute_path(key: str) -> str:
    """The attribute path on Recipe of a dotted key (model.kwargs.NAME excluded), e.g. dp.batch_size ->
    trainer.batch_size; an unknown key is refused by name."""
    known = _section_fields()
    if key not in known:
        raise RecipeError(f"unknown recipe key {key!r}; the keys are: {', '.join(recipe_keys())}")
    return known[key]


def recipe_value(recipe: Recipe, key: str) -> Any:
    """The value of a dotted recipe key (e.g. "run.threads")."""
    target: Any = recipe
    for part in attribute_path(ALIASES.get(key, key)).split("."):
        target = getattr(target, part)
    return target


def recipe_keys() -> list[str]:
    """Every dotted key a recipe file or --set accepts (model.kwargs.NAME takes any NAME the model takes)."""
    return sorted([*_section_fields(), *ALIASES, "model.kwargs.NAME"])


def set_key(recipe: Recipe, key: str, value: Any) -> None:
    """recipe[key] = value for one dotted key; an unknown key is refused, naming it and the known ones."""
    key = ALIASES.get(key, key)
    if key.startswith("model.kwargs."):
        name = key.removeprefix("model.kwargs.")
        if not name.isidentifier():
            raise RecipeError(f"{key}: {name!r} is not a keyword argument name")
        recipe.model.kwargs[name] = tuple(value) if isinstance(value, list) else value
        return
    path = attribute_path(key).split(".")
    target: Any = recipe
    for part in path[:-1]:
        target = getattr(target, part)
    if key == "model.kwargs":
        if not isinstance(value, dict):
            raise RecipeError(f"{key} must be a table of keyword arguments, got {value!r}")
        value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
    hint = typing.get_type_hints(type(target))[path[-1]]
    fits, value = matches(value, hint)
    if not fits:  # e.g. "no" for a bool, which would otherwise count as true
        raise RecipeError(f"{key} takes {describe(hint)}, got {value!r}")
    setattr(target, path[-1], value)


def _flatten(table: dict[str, Any]) -> dict[str, Any]:
    """{section: {key: value}} -> {"section.key": value}; model.kwargs stays one table."""
    flat: dict[str, Any] = {}
    for section, body in table.items():
        if not isinstance(body, dict):
            raise RecipeError(
                f"{section!r} must be a section ([model], [conversion], [data], [adapt], [dp], [schedule], "
                f"[run]), not a top-level value"
            )
        flat.update({f"{section}.{key}": value for key, value in body.items()})
    return flat


def recipe_from_dict(table: dict[str, Any], base: Recipe | None = None) -> Recipe:
    """`base` (default: all defaults) with every key of the nested table set; unknown keys refused by name."""
    recipe = copy.deepcopy(base) if base is not None else Recipe()
    for key, value in _flatten(table).items():
        set_key(recipe, key, value)
    return recipe


def shipped_recipes() -> dict[str, str]:
    """The recipes that ship with equiconvert: name -> first comment line (what it trains)."""
    found = {}
    for entry in sorted(resources.files(__package__).joinpath(RECIPE_DIR).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            first = entry.read_text().splitlines()[0] if entry.read_text() else ""
            found[entry.name.removesuffix(".toml")] = first.lstrip("# ").strip()
    return found


def recipe_text(name_or_path: str) -> tuple[str, str]:
    """The TOML text of a recipe file, or of a shipped recipe named without folder or suffix; also where it is."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise RecipeError(
                f"name_or_path={name_or_path}: no such file (shipped recipes: "
                f"{', '.join(shipped_recipes())}; list them with `equiconvert recipes`)"
            )
        return path.read_text(), str(path)
    shipped = resources.files(__package__).joinpath(RECIPE_DIR, f"{name_or_path}.toml")
    if not shipped.is_file():
        raise RecipeError(
            f"name_or_path={name_or_path}: neither a file nor a shipped recipe (shipped: {', '.join(shipped_recipes())})"
        )
    return shipped.read_text(), f"equiconvert/recipes/{RECIPE_DIR}/{name_or_path}.toml"


def load_recipe(name_or_path: str) -> Recipe:
    """The recipe in a TOML file (a path, or a shipped recipe's name), over the defaults."""
    text, where = recipe_text(name_or_path)
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{where}: not valid TOML ({exc})") from None
    try:
        return recipe_from_dict(table)
    except RecipeError as exc:
        raise RecipeError(f"{where}: {exc}") from None


def parse_value(text: str) -> Any:
    """A --set value as a TOML scalar or array (2, 1e-5, true, "x", [8, 16]); anything else is a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_assignment(text: str) -> tuple[str, Any]:
    """'dp.epsilon=2' -> ('dp.epsilon', 2.0 as TOML reads it); errors name apply_overrides' parameter."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError(f"assignments={text!r}: give KEY=VALUE, e.g. dp.epsilon=2 or model.kwargs.norm_groups=4")
    return key.strip(), parse_value(value.strip())


def apply_overrides(recipe: Recipe, assignments: list[str]) -> Recipe:
    """A copy of `recipe` with each KEY=VALUE assignment applied in order."""
    recipe = copy.deepcopy(recipe)
    for text in assignments:
        key, value = parse_assignment(text)
        try:
            set_key(recipe, key, value)
        except RecipeError as exc:
            raise RecipeError(f"assignments={text}: {exc}") from None
    return recipe


def parse_kwargs(model_kwargs: str) -> dict[str, Any]:
    """--model-kwargs 'widths=8,16,32,norm_groups=4' -> {'widths': (8, 16, 32), 'norm_groups': 4}: a comma
    starts a new pair only before NAME=, so list values need no brackets; values are read as by parse_value."""
    kwargs: dict[str, Any] = {}
    for pair in re.split(r",\s*(?=[A-Za-z_]\w*\s*=)", model_kwargs.strip()):
        name, sep, value = pair.partition("=")
        if not sep or not name.strip().isidentifier():
            raise RecipeError(f"model_kwargs={model_kwargs!r}: give key=value pairs, e.g. widths=8,16,32,norm_groups=4")
        parts = [parse_value(part.strip()) for part in value.split(",")] if "," in value else None
        kwargs[name.strip()] = tuple(parts) if parts is not None else parse_value(value.strip())
    return kwargs
