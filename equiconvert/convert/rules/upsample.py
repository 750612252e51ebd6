"""Upsampling by an integer factor (HRNet, FPN-style necks).

Nearest, bilinear and bicubic interpolation by an integer factor are exact on the grid
at every input size: each sample position depends only on its distance to the borders,
and a 90-degree rotation or a flip maps those distances onto each other. One scale per
axis and field-blind interpolation keep fields whole.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..context import ConversionContext
from ..fields import FieldType
from ..grid import ScaleOp
from ..registry import register_function_rule, register_module_rule, takes_direct_sums

EXACT_MODES = ("nearest", "nearest-exact", "bilinear", "bicubic")


def _upsample(ctx: ConversionContext, node: fx.Node, size, scale, mode: str) -> FieldType:
    t = ctx.field_input(node)
    if not t.spatial or t.channels_last:
        raise ctx.unsupported(node, "upsamples a tensor that is not a channels-first feature map")
    if mode not in EXACT_MODES:
        raise ctx.unsupported(node, f"mode={mode!r} is not exact on the grid; exact modes: {EXACT_MODES}")
    if size is not None:
        shape_in, shape_out = ctx.shape(node.args[0]), ctx.shape(node)
        if shape_out[2] % shape_in[2] or shape_out[2] // shape_in[2] != shape_out[3] // shape_in[3]:
            raise ctx.unsupported(
                node,
                f"upsamples to a fixed size {size}, which is no integer factor of its input",
                "Options: use scale_factor= with an integer factor.",
            )
        scale = shape_out[2] // shape_in[2]
    factors = set(scale) if isinstance(scale, (tuple, list)) else {scale}
    if len(factors) != 1 or float(next(iter(factors))) != int(next(iter(factors))):
        raise ctx.unsupported(node, f"scale_factor={scale} is not one integer for both axes")
    ctx.set_spatial(node, ScaleOp(int(next(iter(factors)))))
    return t


@register_module_rule(nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d)
@takes_direct_sums
def convert_upsample_module(ctx: ConversionContext, node: fx.Node) -> FieldType:
    module = ctx.module(node)
    return _upsample(ctx, node, module.size, module.scale_factor, module.mode)


@register_function_rule(F.interpolate, F.upsample)
@takes_direct_sums
def convert_interpolate(ctx: ConversionContext, node: fx.Node) -> FieldType:
    def arg(index: int, name: str, default=None):
        return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)

    return _upsample(ctx, node, arg(1, "size"), arg(2, "scale_factor"), arg(3, "mode", "nearest"))
