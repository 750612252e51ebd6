"""Spatial pooling: kept as is, with its window recorded for the grid analysis.

A 2x2 stride-2 pool with ceil_mode=True (timm's ResNet-D shortcut) is replaced by
a 3x3 stride-2 pool with padding 1: same output size at every input size, and
symmetric windows at the odd sizes that the stride-2 convs beside it need.
A max pool over non-overlapping windows becomes WindowMaxPool2d: the same
function with a faster backward.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...nn import NormMaxPool2d, WindowMaxPool2d
from ..context import ConversionContext
from ..fields import FieldType
from ..grid import AdaptiveOp, WindowOp
from ..registry import head_transparent, register_function_rule, register_module_rule, takes_direct_sums
from .head import insert_invariant_map


def _single(ctx: ConversionContext, node: fx.Node, name: str, value) -> int:
    if isinstance(value, (tuple, list)):
        if len(set(value)) != 1:
            raise ctx.unsupported(node, f"{name}={tuple(value)} is not square; rotations swap height and width")
        return int(value[0])
    return int(value)


def _is_ceil_downsample(pool: nn.Module, kernel: int, stride: int, padding: int) -> bool:
    return kernel == 2 and stride == 2 and padding == 0 and pool.ceil_mode


@register_module_rule(nn.MaxPool2d, nn.AvgPool2d)
@head_transparent
@takes_direct_sums
def convert_window_pool(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t_in = ctx.field_input(node)
    pool = ctx.module(node)
    kernel = _single(ctx, node, "kernel_size", pool.kernel_size)
    stride = _single(ctx, node, "stride", pool.stride if pool.stride is not None else kernel)
    padding = _single(ctx, node, "padding", pool.padding)
    dilation = _single(ctx, node, "dilation", getattr(pool, "dilation", 1))
    if isinstance(pool, nn.MaxPool2d) and t_in.representation in NORM_POOLED:
        ceil = pool.ceil_mode
        if _is_ceil_downsample(pool, kernel, stride, padding):  # same rewrite as below: symmetric at odd sizes
            kernel, padding, ceil = 3, 1, False
        ctx.replace_module(
            node, NormMaxPool2d(t_in.num_fields, t_in.group.layout, kernel, stride, padding, dilation, ceil)
        )
        ctx.set_spatial(node, WindowOp(kernel, stride, padding, dilation, ceil))
        return t_in
    if _is_ceil_downsample(pool, kernel, stride, padding):
        if isinstance(pool, nn.AvgPool2d):
            new = nn.AvgPool2d(3, 2, 1, ceil_mode=False, count_include_pad=False)
        else:
            new = nn.MaxPool2d(3, 2, 1)
        ctx.replace_module(node, new)
        kernel, padding, ceil_mode = 3, 1, False
    else:
        ceil_mode = pool.ceil_mode
        if _is_window_max_pool(pool, kernel, stride, padding, dilation):
            ctx.replace_module(node, WindowMaxPool2d(kernel))
    ctx.set_spatial(node, WindowOp(kernel, stride, padding, dilation, ceil_mode))
    return t_in


def _is_window_max_pool(pool: nn.Module, kernel: int, stride: int, padding: int, dilation: int) -> bool:
    """A max pool whose windows tile the input: each element in exactly one window."""
    if not isinstance(pool, nn.MaxPool2d) or pool.ceil_mode or pool.return_indices:
        return False
    return kernel == stride and padding == 0 and dilation == 1


NORM_POOLED = ("field",)  # representations whose max pooling must compare invariant norms


@register_module_rule(nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
@head_transparent
@takes_direct_sums
def convert_adaptive_pool(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t_in = ctx.field_input(node)
    size = ctx.module(node).output_size
    ctx.set_spatial(node, AdaptiveOp(_single(ctx, node, "output_size", size)))
    if isinstance(ctx.module(node), nn.AdaptiveMaxPool2d) and t_in.representation in NORM_POOLED:
        # a max over space of rotating vectors: take invariants first
        return insert_invariant_map(ctx, node, node.args[0], t_in)
    return t_in


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


@register_function_rule(F.adaptive_avg_pool2d, F.adaptive_max_pool2d)
@head_transparent
@takes_direct_sums
def convert_functional_adaptive_pool(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t_in = ctx.field_input(node)
    ctx.set_spatial(node, AdaptiveOp(_single(ctx, node, "output_size", _arg(node, 1, "output_size"))))
    return t_in


@register_function_rule(F.max_pool2d, F.avg_pool2d)
@head_transparent
@takes_direct_sums
def convert_functional_window_pool(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t_in = ctx.field_input(node)
    kernel = _single(ctx, node, "kernel_size", _arg(node, 1, "kernel_size"))
    stride = _single(ctx, node, "stride", _arg(node, 2, "stride") or kernel)
    padding = _single(ctx, node, "padding", _arg(node, 3, "padding", 0))
    ceil_mode = bool(_arg(node, 4 if node.target is F.avg_pool2d else 5, "ceil_mode", False))
    dilation = 1 if node.target is F.avg_pool2d else _single(ctx, node, "dilation", _arg(node, 4, "dilation", 1))
    if node.target is F.max_pool2d and t_in.representation in NORM_POOLED:
        raise ctx.unsupported(
            node,
            f"functional max pooling of {t_in.representation} fields needs norm max pooling",
            "Options: use nn.MaxPool2d, which equiconvert replaces by NormMaxPool2d.",
        )
    if kernel == 2 and stride == 2 and padding == 0 and ceil_mode:
        raise ctx.unsupported(
            node,
            "a functional 2x2 ceil-mode pool cannot be made symmetric in place",
            "Options: use nn.AvgPool2d/nn.MaxPool2d modules, which equiconvert rewrites.",
        )
    ctx.set_spatial(node, WindowOp(kernel, stride, padding, dilation, ceil_mode))
    return t_in
