"""F.pad on feature maps: equal padding on every side kept; HGNet's one-sided pad before 2x2 windows, grown.

A pad of p on every side (zero, reflect, replicate or circular) maps the grid onto itself under
rotations and flips. A zero pad of one pixel on the right and bottom only, feeding 2x2 stride-1
windows (HGNet's stem), keeps the size but centres nothing; under even_kernels="grow" it becomes
a one-pixel pad on every side feeding 3x3 windows (the convs grow by the conv rule, the pools
here): the same output size, centred.
"""

from __future__ import annotations

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..context import ConversionContext
from ..fields import FieldType
from ..grid import WindowOp
from ..registry import register_function_rule

ONE_SIDED = ((0, 1, 0, 1), (1, 0, 1, 0))
MODES = ("constant", "reflect", "replicate", "circular")  # each commutes with rotations and flips when all sides agree


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _two_by_two_window(ctx: ConversionContext, user: fx.Node) -> nn.Module | None:
    """The 2x2 stride-1 unpadded conv or pool that `user` calls, else None."""
    module = ctx.module(user) if user.op == "call_module" else None
    if not isinstance(module, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
        return None
    pairs = [getattr(module, name, 1) for name in ("kernel_size", "stride", "padding", "dilation")]
    kernel, stride, padding, dilation = (p if isinstance(p, tuple) else (p, p) for p in pairs)
    if kernel == (2, 2) and stride == (1, 1) and padding in ((0, 0), "valid") and dilation == (1, 1):
        return module
    return None


def _grow_pool(ctx: ConversionContext, user: fx.Node, pool: nn.Module) -> None:
    grown = nn.MaxPool2d(3, 1, 0) if isinstance(pool, nn.MaxPool2d) else nn.AvgPool2d(3, 1, 0)
    ctx.replace_module(user, grown)


@register_function_rule(F.pad)
def convert_pad(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t = ctx.field_input(node)
    pad, mode, value = tuple(_arg(node, 1, "pad")), _arg(node, 2, "mode", "constant"), _arg(node, 3, "value", None)
    if not t.spatial or t.channels_last or len(pad) != 4 or mode not in MODES or value not in (None, 0, 0.0):
        raise ctx.unsupported(
            node,
            f"pads {pad} in mode {mode!r} with value {value}; rules exist for zero, "
            "reflect, replicate and circular padding of the two spatial dims of a "
            "channels-first map",
        )
    if len(set(pad)) == 1:
        ctx.set_spatial(node, WindowOp(1, 1, pad[0]))
        return t
    windows = [_two_by_two_window(ctx, user) for user in node.users]
    if pad not in ONE_SIDED or mode != "constant" or None in windows or ctx.config.even_kernels != "grow":
        raise ctx.unsupported(
            node,
            f"pads {pad}: unequal sides do not map onto themselves under rotations",
            "Options: pad every side equally; a one-pixel pad on two sides that feeds only 2x2 "
            "stride-1 convs or pools converts with config={'even_kernels': 'grow'}.",
        )
    for user, window in zip(list(node.users), windows):
        if not isinstance(window, nn.Conv2d):  # convs grow by their own rule
            _grow_pool(ctx, user, window)
    node.args = (node.args[0], (1, 1, 1, 1), *node.args[2:])
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "pad"}
    ctx.record(node, f"pad {pad}", "pad (1, 1, 1, 1) before 3x3 windows (even_kernels='grow')")
    ctx.set_spatial(node, WindowOp(1, 1, 1))
    return t
