"""What `equiconvert train` was asked to do: a RunSpec and DPTrainer options, from a recipe."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..training.dp_config import DPConfig
from ..training.loggers import DEFAULT_LOGGERS
from .recipe import AdaptOptions, Recipe, RecipeError

BASELINE_GROUP = "none"  # --group none: the unconverted network


@dataclass
class RunSpec:
    """What `equiconvert train` was asked to do."""

    model: str
    group: str
    dataset: str
    data_dir: str | None
    out: str
    width: str | float | None = None
    # the model's keyword arguments (create_model's, e.g. widths); the paper preset also takes PRESET_KEYS
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    resume: bool = False
    overwrite: bool = False  # replace an earlier run's files in `out` (otherwise a non-empty `out` is refused)
    progress: bool = True
    time_limit_s: float | None = None  # stop (with a checkpoint) after this much training time; --resume continues
    init_gain: float | None = None  # ConversionConfig.init_gain; None keeps the model's default
    head: str | None = None  # "keep" or "invariant"; None: the paper preset's own head, "invariant" for other models
    pad_to_valid: bool = False  # the model pads the images to its nearest valid size (else the runner pads them)
    plan_steps: bool = False  # fit the steps to time_limit_s by a timing probe before the noise is calibrated
    loggers: tuple[str, ...] = DEFAULT_LOGGERS  # where the log records go (training.loggers.LOGGERS)
    classes: tuple[int, ...] | None = None  # keep only these labels (None: every example)
    adapt: AdaptOptions = field(default_factory=AdaptOptions)  # pretrained weights and how they are kept

    def preset(self, key: str) -> Any:
        """A paper-preset keyword argument as given (None: the preset's own)."""
        return self.model_kwargs.get(key)

    def passed_kwargs(self) -> dict[str, Any]:
        """The keyword arguments create_model receives as they are (the preset's own ones are built separately)."""
        return {k: v for k, v in self.model_kwargs.items() if k not in PRESET_KEYS}

    def conversion_kwargs(self) -> dict[str, Any]:
        """The model keyword arguments that are ConversionConfig fields (e.g. weight_standardization, unit_invariants):
        they go to the conversion, so the plain network is built without them."""
        from ..convert.context import ConversionConfig

        names = {f.name for f in dataclasses.fields(ConversionConfig)}
        return {k: v for k, v in self.passed_kwargs().items() if k in names}


# the paper preset's keyword arguments (its conv -> activation -> norm blocks and last stage), refused for other
# models; their defaults are equiconvert.models.equivariant_resnet9.PresetOptions'
PRESET_KEYS = ("activation", "norm_groups", "res2", "pool_after_res2")


def spec_of(recipe: Recipe) -> RunSpec:
    """The RunSpec of a recipe; data.dataset and run.out must be set (by the recipe file or the flags)."""
    for key, value in (("data.dataset", recipe.data.dataset), ("run.out", recipe.run.out)):
        if value is None:
            raise RecipeError(f"{key} is not set: give it in the recipe, or override it (assignments={key}=...)")
    m, c, r = recipe.model, recipe.conversion, recipe.run
    return RunSpec(
        model=m.name,
        group=c.group,
        dataset=recipe.data.dataset,
        data_dir=recipe.data.data_dir,
        out=r.out,
        width=c.width,
        model_kwargs=dict(m.kwargs),
        device=r.device,
        resume=r.resume,
        overwrite=r.overwrite,
        progress=r.progress,
        time_limit_s=r.time_limit_s,
        init_gain=c.init_gain,
        head=c.head,
        pad_to_valid=c.pad_to_valid,
        plan_steps=r.plan_steps,
        loggers=tuple(r.loggers),
        classes=recipe.data.classes,
        adapt=dataclasses.replace(recipe.adapt),
    )


def trainer_config(recipe: Recipe) -> DPConfig:
    """The recipe's DPConfig as DPConfig reads it (a recipe's 0: off, None; the recipe itself is left as set)."""
    return DPConfig(**dataclasses.asdict(recipe.trainer))


def trainer_options(recipe: Recipe) -> dict[str, Any]:
    """The recipe's DPConfig as DPTrainer's keyword arguments (trainer_config's fields)."""
    return dataclasses.asdict(trainer_config(recipe))
