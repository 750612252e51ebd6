"""The model a run trains, built from its RunSpec: the paper's preset, or a registry model converted (or, for the
"none" baseline, kept with its BatchNorms made DP-safe), and the input size at which it is exactly equivariant."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ParameterError
from ..convert import make_equivariant
from ..conversion_options import INVARIANT_HEAD
from ..models._registry import ModelEntry, model_entry, preset_names
from ..models.equivariant_resnet9 import PresetOptions
from .run_spec import BASELINE_GROUP, PRESET_KEYS, RunSpec


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def replace_batch_norm(model: nn.Module) -> nn.Module:
    """For the unconverted baseline: BatchNorm (batch statistics) -> GroupNorm, as Opacus' ModuleValidator.fix does."""
    from opacus.validators import ModuleValidator

    return ModuleValidator.fix(model)


def preset_entry(spec: RunSpec) -> ModelEntry | None:
    """The registry entry of spec.model if it is a preset (an equivariant model with its own plain network)."""
    entry = model_entry(spec.model)
    return entry if entry is not None and entry.preset is not None else None


def preset_model(
    spec: RunSpec, entry: ModelEntry, preset: PresetOptions, num_classes: int, channels: int
) -> tuple[nn.Module, int]:
    """The preset `entry` built for spec.group, or, for "none", the plain network it converts (entry.baseline),
    both with `preset`'s options; also the plain network's size."""
    from ..models import create_model

    if "widths" in spec.model_kwargs:
        raise ParameterError(
            f"{spec.model} has its own layout; the keyword widths does not apply to it (the recipe key "
            "conversion.width changes its conversion's width rule)"
        )
    built = {"act": preset.activation, "norm_groups": preset.norm_groups, **blocks_of(preset)}
    try:
        plain = create_model(
            entry.baseline,
            num_classes=num_classes,
            in_channels=channels,
            **built,
            **{k: v for k, v in spec.passed_kwargs().items() if k not in spec.conversion_kwargs()},
        )
    except ValueError as exc:
        raise ParameterError(f"norm_groups {spec.preset('norm_groups')}: {exc}") from exc
    if spec.group.lower() == BASELINE_GROUP:
        return plain, count_parameters(plain)
    width = {} if spec.width is None else {"width": spec.width}
    model = create_model(
        entry.name,
        group=spec.group,
        num_classes=num_classes,
        in_channels=channels,
        head=head_of(spec),
        **width,
        **built,
        **conversion_options(spec),
        **spec.passed_kwargs(),
    )
    return model, count_parameters(plain)


def preset_of(spec: RunSpec) -> PresetOptions | None:
    """A preset's options as built from spec's model keywords; None for other models (their own)."""
    entry = preset_entry(spec)
    if entry is None:
        return None
    return entry.preset.resolve(**{key: spec.preset(key) for key in PRESET_KEYS})


def blocks_of(preset: PresetOptions | None) -> dict[str, bool | None]:
    """A preset's last-stage choices as built (res2, pool_after_res2); None for other models."""
    if preset is None:
        return {"res2": None, "pool_after_res2": None}
    return {"res2": preset.res2, "pool_after_res2": preset.pool_after_res2}


def head_of(spec: RunSpec) -> str:
    """The converted model's head: as asked, else a registered model's own (the paper preset's 2x2 grid), else
    global pooling."""
    if spec.head is not None:
        return spec.head
    entry = model_entry(spec.model)
    own = entry.default_head if entry is not None and entry.equivariant else None
    return own or INVARIANT_HEAD


# options that only a converted model has, and what each sets: refused for the unconverted baseline
_CONVERSION_KEYS = {
    "init_gain": ("conversion.init_gain", "the steerable filters' initial scale"),
    "head": ("conversion.head", "the converted model's head"),
    "width": ("conversion.width", "the conversion's width rule"),
}


def refuse_preset_options_for_other_models(spec: RunSpec) -> None:
    if preset_entry(spec) is not None:
        if spec.pad_to_valid:
            raise ParameterError(
                f"conversion.pad_to_valid applies to converted registry models, not the preset {spec.model!r} "
                "(its images are padded to a valid size by the run): drop it"
            )
        return
    presets = " or ".join(preset_names())
    for key in PRESET_KEYS:
        if spec.preset(key) is not None:
            raise ParameterError(
                f"the model keyword {key} applies to {presets} only (its conv -> activation -> norm blocks), "
                f"not {spec.model!r}: drop it, or train {presets}"
            )


def refuse_conversion_options_for_baseline(spec: RunSpec) -> None:
    if spec.group.lower() != BASELINE_GROUP:
        return
    if spec.conversion_kwargs():  # the plain network is built without them
        raise ParameterError(
            f"model.kwargs {sorted(spec.conversion_kwargs())} are conversion options; the unconverted baseline "
            "(group=none) has no conversion: drop them, or pick a group"
        )
    if spec.pad_to_valid:
        raise ParameterError("conversion.pad_to_valid fits a converted model's input; group=none has none: drop it")
    for name, (key, what) in _CONVERSION_KEYS.items():
        if getattr(spec, name) is not None:
            raise ParameterError(
                f"{key} sets {what}; the unconverted baseline (group=none) has none: drop {key}, or pick a group"
            )


def conversion_options(spec: RunSpec) -> dict[str, Any]:
    return {} if spec.init_gain is None else {"init_gain": spec.init_gain}


def build_model(spec: RunSpec, num_classes: int, channels: int, image_size: int | None = None) -> tuple[nn.Module, int]:
    """The network the run trains, and the parameter count of the plain network it comes from; with
    spec.pad_to_valid, a converted registry model takes `image_size` and pads it to its nearest valid size itself."""
    from ..models import create_model

    entry = preset_entry(spec)
    if entry is not None:
        return preset_model(spec, entry, preset_of(spec), num_classes, channels)
    conversion = spec.conversion_kwargs()  # ConversionConfig fields among the model keywords go to the conversion
    built = {k: v for k, v in spec.passed_kwargs().items() if k not in conversion}
    model = create_model(spec.model, num_classes=num_classes, in_channels=channels, **built)
    params_before = count_parameters(model)
    if spec.group.lower() == BASELINE_GROUP:
        return replace_batch_norm(model), params_before
    fit = {"input_size": image_size, "pad_to_valid": True} if spec.pad_to_valid else {}
    converted = make_equivariant(
        model,
        spec.group,
        width=spec.width,
        head=head_of(spec),
        config={**conversion, **conversion_options(spec)},
        **fit,
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
