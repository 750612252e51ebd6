"""timm's BlurPool2d (anti-aliased downsampling, TResNet) -> SymmetricBlurPool2d on every channel."""

from __future__ import annotations

import torch.fx as fx

from ...nn.blur_pool import SymmetricBlurPool2d
from ..context import ConversionContext
from ..fields import FieldType
from ..grid import WindowOp
from ..registry import register_module_rule


@register_module_rule("timm.layers.blur_pool:BlurPool2d")
def convert_blur_pool(ctx: ConversionContext, node: fx.Node) -> FieldType:
    module, t = ctx.module(node), ctx.field_input(node)
    if not t.spatial or t.channels_last:
        raise ctx.unsupported(node, "blurs a tensor that is not a channels-first feature map")
    padding = set(module.padding)
    if len(padding) != 1:
        raise ctx.unsupported(node, f"padding={module.padding} differs between sides")
    kernel = module.filt[0, 0].detach().cpu()
    try:
        new = SymmetricBlurPool2d(kernel, module.stride, padding.pop(), module.pad_mode)
    except ValueError as exc:
        raise ctx.unsupported(node, str(exc)) from exc
    ctx.replace_module(node, new)
    ctx.set_spatial(node, WindowOp(module.filt_size, module.stride, new.padding))
    return t
