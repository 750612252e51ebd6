"""nn.ConvTranspose2d -> SteerableConvTranspose2d (UNet / LinkNet decoders).

Odd kernels take the convolution's basis; even ones (2x2 stride-2 up-samplers, 4x4 stride-2 padding-1 ones) take
the exact grid-orbit basis, which exists for groups whose every element maps the pixel grid onto itself.
output_padding shifts the output off the input's centre, so it is refused with the settings that keep it centred.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from ...basis import grid_orbit_basis, steerable_basis
from ...conversion_options import ESCNN_COORDINATES
from ...nn.conv import standardization_scope
from ...nn.conv_transpose import SteerableConvTranspose2d
from ..context import ConversionContext
from ..fields import FieldType
from ..grid import TransposedWindowOp
from ..registry import is_classifier_conv, register_module_rule
from .conv import _output_fields, _square, bias_scale, standardization_coordinates

CENTRED_SETTINGS = "kernel_size=2, stride=2 or kernel_size=4, stride=2, padding=1, with output_padding=0"


def _basis(ctx: ConversionContext, node: fx.Node, t_in: FieldType, out_repr: str, kernel: int):
    if kernel % 2:
        return steerable_basis(t_in.group, t_in.representation, out_repr, kernel, cutoff=ctx.config.basis_cutoff)
    if len(getattr(t_in.group, "elements", ())) != len(t_in.group.grid_elements):
        raise ctx.unsupported(
            node,
            f"even kernel_size={kernel} under {t_in.group.name}, whose rotations move its taps off the pixel grid",
            "Options: convert to C4 or D4 (or a subgroup), or use an odd kernel_size.",
        )
    return grid_orbit_basis(t_in.group, t_in.representation, out_repr, kernel)


@register_module_rule(nn.ConvTranspose2d)
def convert_conv_transpose2d(ctx: ConversionContext, node: fx.Node) -> FieldType:
    conv: nn.ConvTranspose2d = ctx.module(node)
    t_in = ctx.field_input(node)
    if len(node.args) > 1 or node.kwargs:
        raise ctx.unsupported(
            node, "is called with output_size", f"Options: call it on the input alone ({CENTRED_SETTINGS})."
        )
    kernel = _square(node, ctx, "kernel_size", conv.kernel_size)
    stride = _square(node, ctx, "stride", conv.stride)
    dilation = _square(node, ctx, "dilation", conv.dilation)
    padding = _square(node, ctx, "padding", conv.padding)
    if any(conv.output_padding):
        raise ctx.unsupported(
            node,
            f"output_padding={conv.output_padding} adds a row and a column at the bottom right, so the output is not "
            "centred on the input and no input size keeps it equivariant",
            f"Options: use {CENTRED_SETTINGS}, or bilinear upsampling and a conv.",
        )
    weight_standardization = ctx.config.weight_standardization
    if (
        kernel % 2 == 0
        and standardization_scope(weight_standardization) is not None
        and (ctx.config.standardization_coordinates == ESCNN_COORDINATES)
    ):
        raise ctx.unsupported(
            node,
            f"even kernel_size={kernel} has no escnn basis to standardize in",
            "Options: standardization_coordinates='canonical', or an odd kernel_size.",
        )
    if is_classifier_conv(ctx, node) and conv.groups == 1:
        out_repr, (out_fields, groups) = "trivial", (conv.out_channels, 1)
    else:
        out_repr, (out_fields, groups) = t_in.group.hidden_repr, _output_fields(ctx, node, conv, t_in)
    coordinates = None
    if kernel % 2:
        coordinates = standardization_coordinates(
            ctx, weight_standardization, t_in.group, t_in.representation, out_repr, kernel
        )
    new = SteerableConvTranspose2d(
        _basis(ctx, node, t_in, out_repr, kernel),
        t_in.num_fields,
        out_fields,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        bias=conv.bias is not None,
        weight_standardization=weight_standardization,
        standardization_coordinates=coordinates,
        init_gain=ctx.config.init_gain,
        bias_channels=t_in.group.bias_channels(out_repr),
        bias_scale=bias_scale(ctx, t_in.group, out_repr),
    )
    ctx.replace_module(node, new)
    ctx.set_spatial(node, TransposedWindowOp(kernel, stride, padding, dilation))
    return FieldType(t_in.group, out_repr, out_fields)
