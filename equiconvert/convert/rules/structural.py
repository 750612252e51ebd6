"""Ops that keep field types: identities, dropout, residual arithmetic, concatenation, sizes."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..context import ConversionContext
from ..fields import FieldSum, FieldType, Segment, join
from ..registry import head_transparent, register_function_rule, register_module_rule, takes_direct_sums
from .head import is_parameter_view
from .norm_act import layer_scale_module
from .split import convert_channel_getitem

PASS_THROUGH_MODULES: list[type | str] = [
    nn.Identity,
    nn.Dropout,
    nn.Dropout2d,
    nn.AlphaDropout,
    # per-sample stochastic depth keeps whole samples: equivariant in distribution (registered when imported)
    "torchvision.ops:StochasticDepth",
    "timm.layers:DropPath",
]


@register_module_rule(*PASS_THROUGH_MODULES)
@register_function_rule(F.dropout, F.dropout2d, "contiguous", "clone", "float", "to", "detach")
@head_transparent
@takes_direct_sums
def convert_pass_through(ctx: ConversionContext, node: fx.Node) -> FieldType | None:
    return ctx.type_of(node.args[0])


@register_function_rule("size", getattr)
@takes_direct_sums
def convert_size(ctx: ConversionContext, node: fx.Node) -> None:
    if node.target is getattr and node.args[1] not in ("shape", "dtype", "device"):
        raise ctx.unsupported(node, f"reads attribute {node.args[1]!r} of a feature tensor")
    return None


@register_function_rule(operator.getitem)
@takes_direct_sums
def convert_getitem(ctx: ConversionContext, node: fx.Node) -> FieldType | None:
    piece = convert_channel_getitem(ctx, node)  # pieces of channel splits, slices over whole fields
    if piece is not None:
        return piece
    if ctx.type_of(node.args[0]) is not None:
        raise ctx.unsupported(
            node,
            "indexes a feature tensor, which can split fields",
            "Options: select whole fields, or restructure the model before converting.",
        )
    return None


def _binary(ctx: ConversionContext, node: fx.Node) -> FieldType:
    types = [ctx.type_of(a) for a in node.args[:2]]
    tensors = [t for t in types if t is not None]
    if not tensors:
        return None
    first = tensors[0]
    for other in tensors[1:]:
        if (other.group, other.representation, other.num_fields) != (
            first.group,
            first.representation,
            first.num_fields,
        ):
            raise ctx.unsupported(
                node,
                f"combines field types {first.describe()} and {other.describe()}",
                "Options: let a convolution make each side of the sum (a stem conv before a residual on the image "
                "or on a concatenation with it), or pass width= as a callable that gives both sides one field count.",
            )
    return first if all(t.spatial for t in tensors) or len(tensors) == 1 else first.flattened()


@register_function_rule(operator.floordiv, operator.mod, operator.neg, operator.pow)
def convert_size_arithmetic(ctx: ConversionContext, node: fx.Node) -> None:
    if any(ctx.type_of(a) is not None for a in node.all_input_nodes):
        raise ctx.unsupported(node, "applies integer arithmetic to a feature tensor")
    return None


IN_PLACE_BINARY = {operator.iadd: operator.add, operator.imul: operator.mul, "add_": "add", "mul_": "mul"}


@register_function_rule(operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.mul, "add", "mul")
def convert_elementwise_binary(ctx: ConversionContext, node: fx.Node) -> FieldType | None:
    if node.target in (operator.mul, torch.mul, "mul"):
        scaled = _layer_scale(ctx, node)
        if scaled is not None:
            return scaled
    return _binary(ctx, node)


def _layer_scale(ctx: ConversionContext, node: fx.Node) -> FieldType | None:
    """x * gamma with gamma a per-channel parameter (torchvision CNBlock, timm ConvNeXt) -> FieldLayerScale."""
    args = list(node.args[:2])
    params = [a for a in args if is_parameter_view(a)]
    tensors = [a for a in args if ctx.type_of(a) is not None]
    if len(params) != 1 or len(tensors) != 1:
        return None
    t, root = ctx.type_of(tensors[0]), params[0]
    while root.op != "get_attr":
        root = root.args[0]
    gamma = ctx.gm.get_parameter(str(root.target))
    if gamma.numel() == 1:  # one scalar gain (HGNet's learnable affine) commutes with everything
        return t
    shape = ctx.shape(tensors[0])
    if gamma.numel() != (shape[-1] if t.channels_last or not t.spatial else shape[1]):
        raise ctx.unsupported(
            node,
            f"multiplies a feature map by a parameter of shape {tuple(gamma.shape)}, which is not one gain per channel",
        )
    node.args = (tensors[0],)  # the parameter's view chain is now unused
    ctx.call_module_instead(node, layer_scale_module(t, gamma), "layer_scale")
    _erase_dead(ctx, params[0])
    return t


def _erase_dead(ctx: ConversionContext, node: fx.Node) -> None:
    """Remove a parameter's now unused view chain and the parameter itself."""
    while node is not None and not node.users:
        parent = node.args[0] if node.op == "call_method" else None
        if node.op == "get_attr":
            owner, _, name = str(node.target).rpartition(".")
            delattr(ctx.gm.get_submodule(owner), name)
        ctx.gm.graph.erase_node(node)
        node = parent


@register_function_rule(*IN_PLACE_BINARY)
def convert_in_place_binary(ctx: ConversionContext, node: fx.Node) -> FieldType | None:
    node.target = IN_PLACE_BINARY[node.target]
    return _binary(ctx, node)


@register_function_rule(torch.cat, torch.concat)
@takes_direct_sums
def convert_cat(ctx: ConversionContext, node: fx.Node) -> FieldType | FieldSum:
    """The concatenated maps, kept as segments of the type (a direct sum where representations differ), so that
    slices and splits of the result map onto them."""
    tensors = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    types = [ctx.type_of(t) for t in tensors]
    if any(t is None for t in types):
        raise ctx.unsupported(node, "concatenates a tensor equiconvert could not type")
    spatial = types[0].spatial
    if dim not in ((1, -3) if spatial else (1, -1)) or len({t.spatial for t in types}) != 1:
        raise ctx.unsupported(node, f"concatenates along dim={dim}; only the channel dim (1) keeps fields whole")
    if len({t.group for t in types}) != 1:
        raise ctx.unsupported(node, "concatenates fields of different groups (a restriction on one branch only)")
    joined = join(tuple(Segment(ctx.shape(a)[1], t) for a, t in zip(tensors, types)), spatial)
    if isinstance(joined, FieldSum) and joined.group.hidden_repr != "regular":
        raise ctx.unsupported(
            node,
            f"concatenates {joined.describe()}: direct sums of {joined.group.name} fields are not built",
            "Options: convert to a finite group (C4, D4, ...), or concatenate maps after a convolution.",
        )
    return joined
