"""A run's model when [adapt] gives pretrained weights: loaded into the model [model] builds, then kept as one of
ADAPT_METHODS says (trained as it is, behind a canonicaliser, or carried into the converted model).

The public data set ([adapt] public_*) is read here, apart from the private training set: the canonicaliser learns
the upright pose from it and the carried model's logit error is measured on it, spending no privacy budget.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..data import select_classes
from ..errors import ParameterError
from ..privacy.per_sample_method import PerExampleLoss
from ..training.devices import resolve_device
from ..training.dp_config import DPConfig
from ..training.normalization import Normalize
from ..untrusted_file import load_weights_only
from .build_model import count_parameters
from .recipe import NO_ADAPTATION, AdaptOptions
from .run_spec import BASELINE_GROUP, RunSpec

CARRY_PROBE_IMAGES = 64  # public images on which a carried model's logit error is measured


@dataclass
class AdaptedModel:
    """The model a run trains from pretrained weights, its per-example loss (None: cross-entropy), the plain
    model's parameter count and what result.json records of the adaptation."""

    model: nn.Module
    loss_fn: PerExampleLoss | None
    params_before: int
    record: dict[str, Any]


@dataclass
class AdaptInputs:
    """What every adaptation method reads: the run, its trainer options, the loaded pretrained model, the public
    images (normalised as the trainer normalises; None: no public data set), the images' channels and size, and
    the device."""

    spec: RunSpec
    config: DPConfig
    pretrained: nn.Module
    public_images: torch.Tensor | None
    channels: int
    size: int
    device: str | torch.device | None


def adapts(spec: RunSpec) -> bool:
    """Whether the run starts from pretrained weights (else build_model builds it afresh)."""
    return spec.adapt.method != NO_ADAPTATION or spec.adapt.weights is not None


def pretrained_model(spec: RunSpec, num_classes: int, channels: int) -> nn.Module:
    """The model as [model] builds it, with adapt.weights loaded whole (every parameter and buffer, by name)."""
    from ..models import create_model

    model = create_model(spec.model, num_classes=num_classes, in_channels=channels, **spec.passed_kwargs())
    state = load_weights_only(spec.adapt.weights, map_location="cpu")
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise ParameterError(
            f"adapt.weights={spec.adapt.weights}: not a state dict (name -> tensor); save one with "
            "torch.save(model.state_dict(), PATH)"
        )
    try:
        model.load_state_dict(state)
    except RuntimeError as error:  # missing, unexpected or mis-shaped entries, each named by torch
        raise ParameterError(
            f"adapt.weights={spec.adapt.weights} does not fit {spec.model} as [model] builds it "
            f"({num_classes} classes, {channels} input channels): {error}"
        ) from None
    return model


def public_images(spec: RunSpec, config: DPConfig) -> torch.Tensor | None:
    """adapt.public_dataset's training images of adapt.public_classes, normalised as the trainer normalises."""
    from ..data import load_dataset

    adapt = spec.adapt
    if adapt.public_dataset is None:
        return None
    public = load_dataset(adapt.public_dataset, adapt.public_data_dir, split="train")
    public = select_classes(public, adapt.public_classes, "adapt.public_classes")
    return Normalize(config.normalize_mean, config.normalize_std, torch.device("cpu"))(public.images)


def as_pretrained(inputs: AdaptInputs) -> AdaptedModel:
    """The pretrained model trained as it is (its own architecture, not equivariant)."""
    model = inputs.pretrained
    return AdaptedModel(model, None, count_parameters(model), {"method": NO_ADAPTATION})


def canonicalized(inputs: AdaptInputs) -> AdaptedModel:
    """The pretrained model behind a canonicaliser for conversion.group, first taught the upright pose on the public
    images when there are any; trained with pose_prior_loss."""
    from ..adapt import canonicalize, pose_prior_loss, teach_upright_pose

    adapt = inputs.spec.adapt
    pool = {} if adapt.canonicalizer_pool is None else {"pool": adapt.canonicalizer_pool}
    model = canonicalize(inputs.pretrained, inputs.spec.group, in_channels=inputs.channels, **pool)
    steps = 0 if inputs.public_images is None else adapt.pose_steps
    if steps:
        teach_upright_pose(
            model, inputs.public_images, steps, seed=inputs.config.seed, device=resolve_device(inputs.device)
        )
    record = {"method": "canonicalize", "prior_weight": adapt.prior_weight, "pose_steps": steps}
    return AdaptedModel(
        model, pose_prior_loss(model, weight=adapt.prior_weight), count_parameters(inputs.pretrained), record
    )


def carried(inputs: AdaptInputs) -> AdaptedModel:
    """The pretrained model converted with one regular field per channel and its weights carried (carry_weights):
    at the start, its group average; the logit error is measured on public images (None: carry_weights' own)."""
    from ..adapt.carry import carry_weights, convert_for_carrying

    model = convert_for_carrying(inputs.pretrained, inputs.spec.group, input_size=inputs.size, pad_to_valid=True)
    probe = None if inputs.public_images is None else inputs.public_images[:CARRY_PROBE_IMAGES]
    report = carry_weights(inputs.pretrained, model, probe)
    record = {
        "method": "carry_weights",
        "carry_exact": report.exact,
        "carry_logit_error": report.logit_error,
        "carry_logit_scale": report.logit_scale,
    }
    return AdaptedModel(model, None, count_parameters(inputs.pretrained), record)


# adapt.method -> how the pretrained model is kept; each needs adapt.weights
ADAPT_METHODS: dict[str, Callable[[AdaptInputs], AdaptedModel]] = {
    NO_ADAPTATION: as_pretrained,
    "canonicalize": canonicalized,
    "carry_weights": carried,
}
# the methods that make the model invariant to conversion.group (the others need group "none")
EQUIVARIANT_METHODS = ("canonicalize", "carry_weights")
_PUBLIC_KEYS = ("public_dataset", "public_data_dir", "public_classes")
# the [adapt] keys each method reads besides method and weights: any other key set away from its default is refused
METHOD_KEYS: dict[str, tuple[str, ...]] = {
    NO_ADAPTATION: (),
    "canonicalize": ("prior_weight", "canonicalizer_pool", "pose_steps", *_PUBLIC_KEYS),
    "carry_weights": _PUBLIC_KEYS,
}


def _refuse_unread_keys(spec: RunSpec) -> None:
    """An [adapt] key the run would not read is an error, not a silently dropped setting."""
    adapt, defaults = spec.adapt, AdaptOptions()
    read = {"method", "weights", *METHOD_KEYS[adapt.method]}
    unread = [
        f.name
        for f in fields(AdaptOptions)
        if f.name not in read and getattr(adapt, f.name) != getattr(defaults, f.name)
    ]
    if unread:
        raise ParameterError(
            f"adapt.{unread[0]}={getattr(adapt, unread[0])!r}: adapt.method={adapt.method!r} does not read it; drop it"
        )


def refuse_bad_adaptation(spec: RunSpec) -> None:
    """[adapt] checked before any data or model is touched; errors name the recipe key."""
    adapt = spec.adapt
    if adapt.method not in ADAPT_METHODS:
        raise ParameterError(f"adapt.method={adapt.method!r}: choose one of {list(ADAPT_METHODS)}")
    _refuse_unread_keys(spec)
    if not adapts(spec):
        return
    if adapt.weights is None:
        raise ParameterError(
            f"adapt.method={adapt.method!r} adapts pretrained weights: give adapt.weights (a state-dict file)"
        )
    converting = spec.group.lower() != BASELINE_GROUP
    if converting != (adapt.method in EQUIVARIANT_METHODS):
        raise ParameterError(
            f"adapt.method={adapt.method!r} with conversion.group={spec.group!r}: converting re-initialises every "
            "steerable layer, so pretrained weights need adapt.method='canonicalize' or 'carry_weights' with a group; "
            "adapt.method='none' trains them as they are, with conversion.group='none'"
        )
    if adapt.pose_steps < 0:
        raise ParameterError(f"adapt.pose_steps={adapt.pose_steps}: must be >= 0")
    if adapt.prior_weight < 0:
        raise ParameterError(f"adapt.prior_weight={adapt.prior_weight}: must be >= 0")
    if adapt.public_dataset is None and (adapt.public_data_dir is not None or adapt.public_classes is not None):
        raise ParameterError("adapt.public_data_dir and adapt.public_classes need adapt.public_dataset")
    if spec.conversion_kwargs():
        raise ParameterError(
            f"model.kwargs {sorted(spec.conversion_kwargs())} are conversion options; adapted pretrained weights are "
            "not converted by them: drop them"
        )
    if not Path(adapt.weights).is_file():
        raise ParameterError(
            f"adapt.weights={adapt.weights}: no such file; give a state dict saved with "
            "torch.save(model.state_dict(), PATH)"
        )
    for key in ("width", "init_gain", "head"):
        if getattr(spec, key) is not None:
            raise ParameterError(f"conversion.{key} does not apply to adapted pretrained weights; drop it")
    if spec.pad_to_valid:
        raise ParameterError("conversion.pad_to_valid does not apply to adapted pretrained weights; drop it")


def adapt_model(
    spec: RunSpec, config: DPConfig, num_classes: int, channels: int, size: int, device: str | torch.device | None
) -> AdaptedModel:
    """The run's model from adapt.weights, kept by adapt.method (ADAPT_METHODS)."""
    pretrained = pretrained_model(spec, num_classes, channels)
    inputs = AdaptInputs(spec, config, pretrained, public_images(spec, config), channels, size, device)
    return ADAPT_METHODS[spec.adapt.method](inputs)
