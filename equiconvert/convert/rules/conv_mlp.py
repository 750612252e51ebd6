"""timm's ConvMlp (VGG's convolutional classifier) traced without its size test.

ConvMlp average-pools a map smaller than its first kernel up to that kernel's size, a branch
on the input shape that symbolic tracing cannot follow. Its traceable form moves the test
into `pool_to_min_size` (one graph node, a function rule) and traces fc1, act1, drop, fc2
and act2 as usual. Adaptive pooling places its windows symmetrically, so the test commutes
with rotations and flips.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..context import ConversionContext
from ..fields import FieldType
from ..grid import MinSizeOp
from ..registry import register_function_rule, register_traceable_form


def pool_to_min_size(x: torch.Tensor, size: int) -> torch.Tensor:
    """x, average-pooled up to at least size x size if it is smaller."""
    if x.shape[-2] < size or x.shape[-1] < size:
        return F.adaptive_avg_pool2d(x, (max(size, x.shape[-2]), max(size, x.shape[-1])))
    return x


torch.fx.wrap("pool_to_min_size")


@register_traceable_form("timm.models.vgg:ConvMlp")
def conv_mlp_forward(module, x: torch.Tensor) -> torch.Tensor:
    x = pool_to_min_size(x, module.input_kernel_size)
    return module.act2(module.fc2(module.drop(module.act1(module.fc1(x)))))


@register_function_rule(pool_to_min_size)
def convert_pool_to_min_size(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t = ctx.field_input(node)
    if not t.spatial or t.channels_last:
        raise ctx.unsupported(node, "pools a tensor that is not a channels-first feature map")
    ctx.set_spatial(node, MinSizeOp(node.args[1] if len(node.args) > 1 else node.kwargs["size"]))
    return t
