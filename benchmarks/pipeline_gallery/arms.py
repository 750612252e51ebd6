"""The ways a pipeline's network is trained: as it is, converted (by make_equivariant's options), or widened.

An arm is a name of CONVERSIONS (make_equivariant keywords, "{group}" standing for the pipeline's group), or
"original", or "widened=<arm>": the original with every width multiplied so that its parameter count matches the
conversion <arm> (the control for what width alone buys).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

import equiconvert

from .base import Pipeline

TORCH_CONV_GAIN = 3**-0.5  # std x sqrt(fan-in) of nn.Conv2d's default init
ORIGINAL = "original"
WIDENED_PREFIX = "widened="

CONVERSIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "dp": {"mode": "dp"},
    "restrict_d1": {"restrict": "{group}->D1"},
    "restrict_d1_params": {"restrict": "{group}->D1", "width": "params"},
    "restrict_c1_params": {"restrict": "{group}->C1", "width": "params"},
    "params": {"width": "params"},
    "c4_restrict_c1_params": {"group": "C4", "restrict": "C4->C1", "width": "params"},
    "d1": {"group": "D1"},
    "restrict_d1_torch_gain": {"restrict": "{group}->D1", "config": {"init_gain": TORCH_CONV_GAIN}},
    "default_torch_gain": {"config": {"init_gain": TORCH_CONV_GAIN}},
    "restrict_d1_params_torch_gain": {
        "restrict": "{group}->D1",
        "width": "params",
        "config": {"init_gain": TORCH_CONV_GAIN},
    },
    "d1_params": {"group": "D1", "width": "params"},
}


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def convert(pipeline: Pipeline, arm: str, model: nn.Module) -> nn.Module:
    """The pipeline's network converted as `arm` says."""
    if arm not in CONVERSIONS:
        raise KeyError(f"unknown arm {arm!r}: use {ORIGINAL!r}, {WIDENED_PREFIX}<arm> or one of {sorted(CONVERSIONS)}")
    options = {k: v.format(group=pipeline.group) if isinstance(v, str) else v for k, v in CONVERSIONS[arm].items()}
    group = options.pop("group", pipeline.group)
    if pipeline.conversion_config:
        options["config"] = {**pipeline.conversion_config, **options.get("config", {})}
    # pad_to_valid: a size that breaks exact equivariance (timm's resnet10t at 32: 33 is exact) is padded to the
    # nearest exact one, as the refusal tells a user to; a valid size is left as it is
    return equiconvert.make_equivariant(
        copy.deepcopy(model), group, input_size=pipeline.input_size, pad_to_valid=True, **options
    )


def widened(pipeline: Pipeline, target: int) -> tuple[nn.Module, float]:
    """The original widened until its parameter count is closest to `target` (bisection on the multiplier)."""
    low, high = 1.0, 1.0
    while parameter_count(pipeline.build(high)) < target:
        high *= 1.5
    for _ in range(24):
        middle = (low + high) / 2
        low, high = (middle, high) if parameter_count(pipeline.build(middle)) <= target else (low, middle)
    best = min((low, high), key=lambda w: abs(parameter_count(pipeline.build(w)) - target))
    return pipeline.build(best), best


def build_arm(pipeline: Pipeline, arm: str) -> tuple[nn.Module, dict[str, Any]]:
    """(model, facts about it) for one arm; the original is built once more inside, from the same seed."""
    original = pipeline.build(1.0)
    facts: dict[str, Any] = {"params_original": parameter_count(original)}
    if arm == ORIGINAL:
        model = original
    elif arm.startswith(WIDENED_PREFIX):
        target = parameter_count(convert(pipeline, arm[len(WIDENED_PREFIX) :], original))
        model, facts["width_multiplier"] = widened(pipeline, target)
        facts["params_target"] = target
    else:
        model = convert(pipeline, arm, original)
        report = getattr(model, "report", None)
        facts["conversion"] = " | ".join(str(report).splitlines()[:2]) if report is not None else None
    facts["params"] = parameter_count(model)
    return model, facts
