"""The model a run trains, built from its RunSpec: the paper's preset, or a registry model converted (or, for the
"none" baseline, kept with its BatchNorms made DP-safe), and the input size at which it is exactly equivariant."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ParameterError
from ..convert import make_equivariant
from ..conversion_options import INVARIANT_HEAD, KEEP_HEAD
from ..models.equivariant_resnet9 import PresetOptions
from .run_spec import BASELINE_GROUP, PRESET_KEYS, RunSpec


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def replace_batch_norm(model: nn.Module) -> nn.Module:
    """For the unconverted baseline: BatchNorm (batch statistics) -> GroupNorm, as Opacus' ModuleValidator.fix does."""
    from opacus.validators import ModuleValidator

    return ModuleValidator.fix(model)


PAPER_MODEL = "equiconvert:equivariant_resnet9"


def is_paper_model(spec: RunSpec) -> bool:
    """Whether spec.model names the paper's preset (under any of its registry names)."""
    from ..models._registry import resolve_model_name

    return resolve_model_name(spec.model) == PAPER_MODEL


def paper_model(spec: RunSpec, activation: str, num_classes: int, channels: int) -> tuple[nn.Module, int]:
    """Hölzl et al.'s Equivariant-ResNet9 for spec.group (its own widths and head), or, for "none", the plain
    network it is converted from, with `activation` (a PAPER_ACTIVATIONS name); also the plain network's size."""
    from ..models import create_model

    if "widths" in spec.model_kwargs:
        raise ParameterError(
            f"{PAPER_MODEL} has the paper's layout (16, 32, 64); the keyword widths does not apply to "
            "it (the recipe key conversion.width changes its conversion's width rule)"
        )
    norm_groups = norm_groups_of(spec)
    try:
        plain = create_model(
            "plain_paper_resnet9",
            num_classes=num_classes,
            in_channels=channels,
            act=activation,
            norm_groups=norm_groups,
            **blocks_of(spec),
            **{k: v for k, v in spec.passed_kwargs().items() if k not in spec.conversion_kwargs()},
        )
    except ValueError as exc:
        raise ParameterError(f"norm_groups {spec.preset('norm_groups')}: {exc}") from exc
    if spec.group.lower() == BASELINE_GROUP:
        return plain, count_parameters(plain)
    width = {} if spec.width is None else {"width": spec.width}
    model = create_model(
        PAPER_MODEL,
        group=spec.group,
        num_classes=num_classes,
        in_channels=channels,
        head=head_of(spec),
        act=activation,
        **width,
        norm_groups=norm_groups,
        **blocks_of(spec),
        **conversion_options(spec),
        **spec.passed_kwargs(),
    )
    return model, count_parameters(plain)


def preset_of(spec: RunSpec) -> PresetOptions | None:
    """The paper preset's options as built from spec's model keywords; None for other models (their own)."""
    if not is_paper_model(spec):
        return None
    return PresetOptions.resolve(**{key: spec.preset(key) for key in PRESET_KEYS})


def activation_of(spec: RunSpec) -> str | None:
    """The paper preset's activation, by name (None for other models: their own)."""
    preset = preset_of(spec)
    return None if preset is None else preset.activation


def norm_groups_of(spec: RunSpec) -> int | None:
    """The paper preset's GroupNorm groups as built (None for other models: their own norms)."""
    preset = preset_of(spec)
    return None if preset is None else preset.norm_groups


def blocks_of(spec: RunSpec) -> dict[str, bool | None]:
    """The paper preset's last-stage choices as built (res2, pool_after_res2); None for other models."""
    preset = preset_of(spec)
    if preset is None:
        return {"res2": None, "pool_after_res2": None}
    return {"res2": preset.res2, "pool_after_res2": preset.pool_after_res2}


def head_of(spec: RunSpec) -> str:
    """The converted model's head: as asked, else the paper preset's own (its 2x2 grid), else global pooling."""
    return spec.head or (KEEP_HEAD if is_paper_model(spec) else INVARIANT_HEAD)


# options that only a converted model has, and what each sets: refused for the unconverted baseline
_CONVERSION_KEYS = {
    "init_gain": ("conversion.init_gain", "the steerable filters' initial scale"),
    "head": ("conversion.head", "the converted model's head"),
    "width": ("conversion.width", "the conversion's width rule"),
}


def refuse_preset_options_for_other_models(spec: RunSpec) -> None:
    if is_paper_model(spec):
        return
    for key in PRESET_KEYS:
        if spec.preset(key) is not None:
            raise ParameterError(
                f"the model keyword {key} applies to {PAPER_MODEL} only (its conv -> activation -> norm "
                f"blocks), not {spec.model!r}: drop it, or train {PAPER_MODEL}"
            )


def refuse_conversion_options_for_baseline(spec: RunSpec) -> None:
    if spec.group.lower() != BASELINE_GROUP:
        return
    if is_paper_model(spec) and spec.conversion_kwargs():  # its plain network is built without them
        raise ParameterError(
            f"model.kwargs {sorted(spec.conversion_kwargs())} are conversion options; the unconverted baseline "
            "(group=none) has no conversion: drop them, or pick a group"
        )
    for name, (key, what) in _CONVERSION_KEYS.items():
        if getattr(spec, name) is not None:
            raise ParameterError(
                f"{key} sets {what}; the unconverted baseline (group=none) has none: drop {key}, or pick a group"
            )


def conversion_options(spec: RunSpec) -> dict[str, Any]:
    return {} if spec.init_gain is None else {"init_gain": spec.init_gain}


def build_model(spec: RunSpec, num_classes: int, channels: int) -> tuple[nn.Module, int]:
    """The network the run trains, and the parameter count of the plain network it comes from."""
    from ..models import create_model

    activation = activation_of(spec)
    if activation is not None:  # the paper's preset
        return paper_model(spec, activation, num_classes, channels)
    model = create_model(spec.model, num_classes=num_classes, in_channels=channels, **spec.passed_kwargs())
    params_before = count_parameters(model)
    if spec.group.lower() == BASELINE_GROUP:
        return replace_batch_norm(model), params_before
    converted = make_equivariant(
        model, spec.group, width=spec.width, head=head_of(spec), config=conversion_options(spec)
    )
    return converted, params_before


def padded_size(model: Any, size: int) -> int:
    """Smallest valid input size >= size reachable by symmetric padding (same parity as size)."""
    for candidate in model.report.valid_input_sizes:
        if candidate >= size and (candidate - size) % 2 == 0:
            return candidate
    raise ParameterError(f"no valid input size >= {size} with the parity of {size}: {model.report.valid_input_rule}")


def pad_images(images: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad square images symmetrically to `size` (the converted model's valid input size)."""
    margin = (size - images.shape[-1]) // 2
    return images if margin == 0 else F.pad(images, (margin,) * 4)
