"""The input's channel count, read from the traced graph.

Modules may be registered in another order than they run (a stem defined after the body), so the count comes
from the first convolution that the traced forward runs, divided by the channel folds the graph runs before it
(TResNet's space-to-depth stem), never from the order of `model.modules()`.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from ..errors import UnsupportedLayerError
from .registry import channel_fold

CONVOLUTIONS = (nn.Conv2d, nn.ConvTranspose2d)


def input_channels(gm: fx.GraphModule) -> int:
    """in_channels of the first convolution `gm` runs (the first one inside a leaf module that holds several), over
    the channel folds it runs before that one."""
    fold = 1
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(str(node.target))
        first = next((m for m in module.modules() if isinstance(m, CONVOLUTIONS)), None)  # a leaf may hold convs
        if first is not None:
            return first.in_channels // fold
        fold *= channel_fold(module)
    raise UnsupportedLayerError(
        f"{gm.__class__.__name__}'s forward runs no nn.Conv2d or nn.ConvTranspose2d; equiconvert converts "
        "convolutional networks"
    )
