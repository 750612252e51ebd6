"""Channels-last views of feature maps: permute to (B, H, W, C) and back, Linear over channels as a steerable 1x1."""

from __future__ import annotations

import torch
import torch.fx as fx

from ...basis import steerable_basis
from ...nn.channels_last import ChannelsLastSteerableLinear
from ..context import ConversionContext
from .conv import bias_scale, standardization_coordinates
from ..fields import FieldType
from ..registry import register_function_rule

TO_LAST, TO_FIRST = (0, 2, 3, 1), (0, 3, 1, 2)


def _dims(node: fx.Node) -> tuple[int, ...]:
    dims = node.args[1:] or (node.kwargs.get("dims"),)
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return tuple(d % 4 for d in dims)


@register_function_rule("permute", torch.permute)
def convert_permute(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t = ctx.field_input(node)
    dims = _dims(node)
    if t.spatial and not t.channels_last and dims == TO_LAST:
        return t.permuted(True)
    if t.channels_last and dims == TO_FIRST:
        return t.permuted(False)
    raise ctx.unsupported(
        node, f"permutes dims {dims}; only channels-last {TO_LAST} and back {TO_FIRST} keep fields whole"
    )


def convert_channels_last_linear(ctx: ConversionContext, node: fx.Node, t: FieldType) -> FieldType:
    """nn.Linear on a channels-last map: a steerable 1x1 convolution written as a Linear (called by the Linear rule)."""
    linear = ctx.module(node)
    if linear.in_features != ctx.shape(node.args[0])[-1]:
        raise ctx.unsupported(node, "in_features does not match the traced input")
    out_fields = ctx.fields_for(linear.out_features, t.group)
    out_repr = t.group.hidden_repr
    basis = steerable_basis(t.group, t.representation, out_repr, 1, cutoff=ctx.config.basis_cutoff)
    new = ChannelsLastSteerableLinear(
        basis,
        t.num_fields,
        out_fields,
        bias=linear.bias is not None,
        init_gain=ctx.config.init_gain,
        weight_standardization=ctx.config.weight_standardization,
        standardization_coordinates=standardization_coordinates(
            ctx, ctx.config.weight_standardization, t.group, t.representation, out_repr, 1
        ),
        bias_channels=t.group.bias_channels(out_repr),
        bias_scale=bias_scale(ctx, t.group, out_repr),
    )
    ctx.replace_module(node, new)
    return FieldType(t.group, out_repr, out_fields, spatial=True, channels_last=True)
