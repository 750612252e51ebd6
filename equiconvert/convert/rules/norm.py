"""BatchNorm2d / GroupNorm / InstanceNorm2d -> FieldGroupNorm (per sample, whole fields)."""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from ...nn import FieldGroupNorm, GroupStandardization
from ..context import ConversionContext
from ..fields import FieldType
from ..norm_groups import norm_group_rule
from ..registry import register_module_rule


def _check_channels(ctx: ConversionContext, node: fx.Node, channels: int) -> FieldType:
    t_in = ctx.field_input(node)
    if ctx.shape(node.args[0])[1] != channels:
        raise ctx.unsupported(node, f"normalises {channels} channels but its input has {ctx.shape(node.args[0])[1]}")
    return t_in


def field_norm(t: FieldType, groups: int, affine: bool, eps: float) -> nn.Module:
    """The per-sample norm over whole fields; irrep fields need group standardization (no mean on irreps)."""
    if t.representation in GROUP_STANDARDIZED:
        return GroupStandardization(t.num_fields, t.group.layout, groups, affine, eps)
    return FieldGroupNorm(t.num_fields, t.field_size, groups, affine, eps)


GROUP_STANDARDIZED = ("field",)


@register_module_rule(nn.BatchNorm2d, nn.SyncBatchNorm)
def convert_batchnorm(ctx: ConversionContext, node: fx.Node) -> FieldType:
    bn = ctx.module(node)
    t_in = _check_channels(ctx, node, bn.num_features)
    groups = norm_group_rule(ctx.config.norm_group_rule)(t_in.num_fields, ctx.config.batchnorm_groups)
    ctx.replace_module(node, field_norm(t_in, groups, bn.affine, bn.eps))
    return t_in


@register_module_rule(nn.GroupNorm)
def convert_groupnorm(ctx: ConversionContext, node: fx.Node) -> FieldType:
    gn: nn.GroupNorm = ctx.module(node)
    t_in = _check_channels(ctx, node, gn.num_channels)
    groups = norm_group_rule(ctx.config.norm_group_rule)(t_in.num_fields, gn.num_groups)
    ctx.replace_module(node, field_norm(t_in, groups, gn.affine, gn.eps))
    return t_in


@register_module_rule(nn.InstanceNorm2d)
def convert_instancenorm(ctx: ConversionContext, node: fx.Node) -> FieldType:
    norm: nn.InstanceNorm2d = ctx.module(node)
    t_in = _check_channels(ctx, node, norm.num_features)
    new = field_norm(t_in, t_in.num_fields, norm.affine, norm.eps)
    ctx.replace_module(node, new)
    return t_in
