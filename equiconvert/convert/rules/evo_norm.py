"""timm's EvoNorm layers: the sample-wise S variants -> FieldEvoNorm; the B variants are refused.

EvoNorm-B divides by a running (batch) variance, which mixes the examples of a batch while
training: per-sample gradients and DP-SGD forbid it, as they forbid BatchNorm's statistics.
"""

from __future__ import annotations

import copy

import torch.fx as fx

from ...nn.evo_norm import FieldEvoNorm
from ..context import ConversionContext
from ..fields import FieldType
from ..registry import register_module_rule
from .activation import POINTWISE_REPRESENTATIONS
from .norm_act import check_norm_channels, norm_activation

_EVO = "timm.layers.evo_norm"
# class name -> (statistic, whether it normalises only when its activation is on (the non-"a" forms))
S_VARIANTS = {
    "EvoNorm2dS0": ("std", True),
    "EvoNorm2dS1": ("std", True),
    "EvoNorm2dS0a": ("std", False),
    "EvoNorm2dS1a": ("std", False),
    "EvoNorm2dS2": ("rms", True),
    "EvoNorm2dS2a": ("rms", False),
}
B_VARIANTS = ("EvoNorm2dB0", "EvoNorm2dB1", "EvoNorm2dB2")


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


@register_module_rule(*(f"{_EVO}:{name}" for name in S_VARIANTS))
def convert_evo_norm_s(ctx: ConversionContext, node: fx.Node) -> FieldType:
    module, t = ctx.module(node), ctx.field_input(node)
    check_norm_channels(ctx, node, module.weight.numel(), t)
    if not t.spatial or t.channels_last or t.representation not in POINTWISE_REPRESENTATIONS:
        raise ctx.unsupported(
            node, f"EvoNorm's group statistics need a channels-first map of pointwise fields, not {t.describe()}"
        )
    statistic, only_with_activation = S_VARIANTS[type(module).__name__]
    swish = getattr(module, "v", None) is not None
    activation = None if swish else getattr(module, "act", None)
    normalize = swish or not only_with_activation or module.apply_act
    new = FieldEvoNorm(
        t.num_fields,
        t.field_size,
        _largest_divisor(t.num_fields, module.groups),
        statistic,
        normalize,
        norm_activation(ctx, node, copy.deepcopy(activation), t) if activation is not None else None,
        swish,
        module.eps,
    )
    ctx.replace_module(node, new)
    return t


@register_module_rule(*(f"{_EVO}:{name}" for name in B_VARIANTS))
def refuse_evo_norm_b(ctx: ConversionContext, node: fx.Node) -> FieldType:
    raise ctx.unsupported(
        node,
        f"{type(ctx.module(node)).__name__} divides by a batch variance (a running "
        "statistic while training), which mixes the examples of a batch; DP-SGD needs "
        "per-sample computation",
        "Options: use a sample-wise EvoNorm (EvoNorm2dS0/S1/S2, or their 'a' forms) or GroupNormAct before converting.",
    )
