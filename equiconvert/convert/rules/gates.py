"""ECA/CECA channel attention -> FieldEcaGate: a gate per field from group-pooled (invariant) statistics."""

from __future__ import annotations

import torch.fx as fx

from ...nn.gates import FieldEcaGate
from ..context import ConversionContext
from ..fields import FieldType
from ..registry import register_module_rule
from .norm_act import optional_classes

ECA = optional_classes("timm.layers.eca", "EcaModule")
CECA = optional_classes("timm.layers.eca", "CecaModule")


def _gate(ctx: ConversionContext, node: fx.Node, circular: bool) -> FieldType:
    module, t = ctx.module(node), ctx.field_input(node)
    if getattr(module, "conv2", None) is not None or module.conv.in_channels != 1 or module.conv.bias is not None:
        raise ctx.unsupported(
            node,
            "an ECA gate with a hidden layer or a bias has no field-wise form yet",
            "Options: build the model with the plain ECA gate (no rd_ratio/use_mlp).",
        )
    if not t.spatial or t.channels_last or t.representation not in ("regular", "trivial"):
        raise ctx.unsupported(node, f"an ECA gate needs a channels-first map of regular fields, not {t.describe()}")
    ctx.replace_module(node, FieldEcaGate(t.num_fields, t.field_size, module.conv.kernel_size[0], circular))
    return t


@register_module_rule(*ECA)
def convert_eca(ctx: ConversionContext, node: fx.Node) -> FieldType:
    return _gate(ctx, node, circular=False)


@register_module_rule(*CECA)
def convert_ceca(ctx: ConversionContext, node: fx.Node) -> FieldType:
    return _gate(ctx, node, circular=True)
