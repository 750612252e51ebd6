"""The classifier head: from feature maps to invariant feature vectors.

Global pooling + Linear becomes global pooling + group pooling (one invariant
value per field) + Linear. A head that flattens a spatial grid (ResNet9's
AdaptiveMaxPool2d(2) + Flatten) is group-pooled and then: averaged over the
group's turns and flips (`head="symmetric"`, invariant, the Linear keeps its
shape), pooled globally (`head="invariant"`), or kept as it is and reported as
not invariant (`head="keep"`).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from ...conversion_options import INVARIANT_HEAD, SYMMETRIC_HEAD
from ...nn import GridSymmetrize, GroupPool, InvariantMap
from ...nn.pooling import unit_scale
from ..context import TYPE_KEY, ConversionContext
from ..fields import FieldType
from ..grid import AdaptiveOp
from ..registry import head_transparent, register_function_rule, register_module_rule
from .channels_last import convert_channels_last_linear

ADAPTIVE_POOLS = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)


def _make_global(ctx: ConversionContext, node: fx.Node, x: fx.Node, t: FieldType) -> None:
    """Pool `x` to 1x1 before `node`: shrink the adaptive pool that produced it, or insert one."""
    if x.op == "call_module" and type(ctx.module(x)) in ADAPTIVE_POOLS and len(x.users) == 1:
        ctx.replace_module(x, type(ctx.module(x))(1))
        ctx.set_spatial(x, AdaptiveOp(1))
    else:
        pooled = ctx.insert_before(node, x, nn.AdaptiveAvgPool2d(1), "global_pool", t)
        ctx.set_spatial(pooled, AdaptiveOp(1))


def to_vector(ctx: ConversionContext, node: fx.Node, x: fx.Node) -> FieldType:
    """Type of `node`, which flattens the feature map `x` into (batch, features)."""
    t = ctx.type_of(x)
    if t is None:
        raise ctx.unsupported(node, "flattens a tensor equiconvert could not type")
    if not t.spatial:
        return t
    _, _, height, width = ctx.shape(x)
    cells = height * width
    if cells > 1 and ctx.config.head == INVARIANT_HEAD:
        _make_global(ctx, node, x, t)
        cells = 1
    if cells == 1:
        return t.flattened()
    if ctx.config.head == SYMMETRIC_HEAD:
        return _symmetrize_grid(ctx, node, x, t, cells)
    ctx.spatial_flatten = True
    ctx.warn(
        node,
        f"flattens a {height}x{width} grid: rotations permute its cells, so the output is not invariant "
        "(head='symmetric' averages the grid over the group's turns and flips, head='invariant' pools globally)",
    )
    if not t.is_invariant:
        if x.op == "call_module" and type(ctx.module(x)) in ADAPTIVE_POOLS and len(x.users) == 1:
            # pool over the group first, then over space (Hölzl et al.'s order; the same for max then max)
            x.meta[TYPE_KEY] = insert_invariant_map(ctx, x, x.args[0], t)
        else:
            insert_invariant_map(ctx, node, x, t)
    return FieldType(t.group, "trivial", t.num_fields * cells, spatial=False)


def _symmetrize_grid(ctx: ConversionContext, node: fx.Node, x: fx.Node, t: FieldType, cells: int) -> FieldType:
    """Group-pool `x` and average its grid (square: every rule before refuses a non-square one) over the group's
    turns and flips before `node` flattens it."""
    pooled = insert_invariant_map(ctx, node, x, t)
    actions = [(element.quarter_turns, element.flip) for element in t.group.grid_elements]
    ctx.insert_before(node, node.args[0], GridSymmetrize(actions), "grid_symmetrize", pooled)
    return FieldType(t.group, "trivial", t.num_fields * cells, spatial=False)


def _scale(config, mode: str, field_size: int) -> float:
    """unit_invariants: unit-variance fields give unit-RMS invariants (the scale of the channels they replace)."""
    return unit_scale(mode, field_size) if config.unit_invariants else 1.0


# representation -> (field type, config) -> module mapping each field to one invariant channel
INVARIANT_MAPS = {
    "regular": lambda t, config: GroupPool(
        t.num_fields, t.field_size, config.invariant_pool, _scale(config, config.invariant_pool, t.field_size)
    ),
    # irrep fields: the norm of the whole field (Frobenius over its components); a max over them is not invariant
    "field": lambda t, config: InvariantMap(t.num_fields, t.field_size, scale=_scale(config, "norm", t.field_size)),
}


def insert_invariant_map(ctx: ConversionContext, node: fx.Node, x: fx.Node, t: FieldType) -> FieldType:
    """Map `x`'s fields to invariant channels just before `node`; returns the new type."""
    if t.is_invariant:
        return t
    if t.representation not in INVARIANT_MAPS:
        raise ctx.unsupported(node, f"no invariant map is defined for {t.representation} fields")
    pooled = FieldType(t.group, "trivial", t.num_fields, t.spatial)
    ctx.insert_before(node, x, INVARIANT_MAPS[t.representation](t, ctx.config), "group_pool", pooled)
    return pooled


@register_module_rule(nn.Flatten)
@head_transparent
def convert_flatten_module(ctx: ConversionContext, node: fx.Node) -> FieldType:
    flatten: nn.Flatten = ctx.module(node)
    if flatten.start_dim != 1 or flatten.end_dim not in (-1, 3):
        raise ctx.unsupported(
            node, f"flattens dims {flatten.start_dim}..{flatten.end_dim}; only (batch, features) heads are supported"
        )
    return to_vector(ctx, node, node.args[0])


@register_function_rule(torch.flatten, "flatten")
@head_transparent
def convert_flatten(ctx: ConversionContext, node: fx.Node) -> FieldType:
    start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
    end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
    if start != 1 or end not in (-1, 3):
        raise ctx.unsupported(node, f"flattens dims {start}..{end}; only flatten(x, 1) heads are supported")
    return to_vector(ctx, node, node.args[0])


def is_parameter_view(node) -> bool:
    """True for a get_attr node or a chain of view/reshape calls on one."""
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("view", "reshape"):
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "get_attr"


def _requested_shape(node: fx.Node) -> tuple:
    dims = node.args[1:]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return tuple(dims)


@register_function_rule("view", "reshape", torch.reshape)
@head_transparent
def convert_view(ctx: ConversionContext, node: fx.Node) -> FieldType | None:
    x = node.args[0]
    if is_parameter_view(x):  # a reshaped parameter (layer scale's gamma), handled where it is used
        return None
    t = ctx.field_input(node)
    out_shape = ctx.shape(node)
    if out_shape is None or len(out_shape) != 2 or len(_requested_shape(node)) != 2:
        raise ctx.unsupported(
            node,
            f"reshapes a feature tensor to {out_shape}, which splits fields (e.g. a channel shuffle)",
            "Options: only x.view(batch, -1) style heads are converted; restructure the rest before converting.",
        )
    if not t.spatial:
        return t
    out = to_vector(ctx, node, x)
    batch = _requested_shape(node)[0]
    node.args = (node.args[0], batch, -1) if batch != -1 else (node.args[0], -1, out.channels)
    return out


@register_function_rule("mean", torch.mean)
@head_transparent
def convert_mean(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t = ctx.field_input(node)
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    dims = {d % 4 for d in (dims if isinstance(dims, (tuple, list)) else [dims])} if dims is not None else None
    if not t.spatial or dims != {2, 3}:
        raise ctx.unsupported(node, f"takes a mean over dims {dims}; only the spatial dims (2, 3) keep fields whole")
    if keepdim:
        ctx.set_spatial(node, AdaptiveOp(1))
        return t
    return t.flattened()


@register_module_rule(nn.Linear)
def convert_linear(ctx: ConversionContext, node: fx.Node) -> FieldType:
    linear: nn.Linear = ctx.module(node)
    t = ctx.field_input(node)
    if t.channels_last:
        return convert_channels_last_linear(ctx, node, t)  # ConvNeXt's pointwise MLP
    if t.spatial:
        raise ctx.unsupported(
            node,
            "applies a Linear layer to a channels-first feature map (its width)",
            "Options: use a 1x1 Conv2d, or flatten/pool before the Linear layer.",
        )
    t = insert_invariant_map(ctx, node, node.args[0], t)
    if t.channels != linear.in_features:
        ctx.replace_module(node, nn.Linear(t.channels, linear.out_features, bias=linear.bias is not None))
    return FieldType(t.group, "trivial", linear.out_features, spatial=False)


# timm's Linear (nn.Linear calling F.linear, for AMP under torchscript) converts like nn.Linear
register_module_rule("timm.layers.linear:Linear")(convert_linear)
