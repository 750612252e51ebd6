"""A steerable 1x1 convolution applied to channels-last (B, ..., C) tensors: ConvNeXt's pointwise Linear layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv import SteerableConv2d


class ChannelsLastSteerableLinear(SteerableConv2d):
    """nn.Linear over the last dim with an equivariant 1x1 filter (basis of kernel size 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.expand_filter()[:, :, 0, 0], self.expand_bias())
