"""timm's nn.Conv2d subclasses: weight-standardized convs (NF-Nets, BiT) and TensorFlow 'SAME' padding (tf_* models).

Weight standardization moves to the coefficients of the steerable filter (SteerableConv2d's
weight_standardization); ScaledStdConv2d's learned per-channel gain is dropped: a per-channel
gain inside a field would break equivariance. TF 'SAME' padding is symmetric, d(k-1)/2 a side,
exactly at the input sizes where a strided window is symmetric, so the converted conv pads that.
"""

from __future__ import annotations

import torch.fx as fx

from ..context import ConversionContext
from ..fields import FieldType
from ..registry import register_module_rule
from .conv import convert_conv
from .norm_act import optional_classes


STANDARDIZED = optional_classes("timm.layers.std_conv", "StdConv2d", "ScaledStdConv2d")
STANDARDIZED_SAME = optional_classes("timm.layers.std_conv", "StdConv2dSame", "ScaledStdConv2dSame")
SAME = optional_classes("timm.layers.conv2d_same", "Conv2dSame")


@register_module_rule(*STANDARDIZED)
def convert_std_conv(ctx: ConversionContext, node: fx.Node) -> FieldType:
    return convert_conv(ctx, node, weight_standardization=True, same_padding=False)


@register_module_rule(*STANDARDIZED_SAME)
def convert_std_conv_same(ctx: ConversionContext, node: fx.Node) -> FieldType:
    return convert_conv(ctx, node, weight_standardization=True, same_padding=True)


@register_module_rule(*SAME)
def convert_conv_same(ctx: ConversionContext, node: fx.Node) -> FieldType:
    return convert_conv(ctx, node, ctx.config.weight_standardization, same_padding=True)
