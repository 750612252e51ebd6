"""Anti-aliased downsampling with a fixed symmetric filter, for any number of channels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ParameterError


class SymmetricBlurPool2d(nn.Module):
    """Pad, then a depthwise conv with one fixed filter on every channel, with a stride.

    A filter that 90-degree rotations and flips map onto itself (a binomial blur) applied to every
    channel alike commutes with the group on any field type; equal padding on every side keeps
    the windows symmetric where the strided grid is (see convert/grid.py).
    """

    def __init__(self, kernel: torch.Tensor, stride: int, padding: int, pad_mode: str) -> None:
        super().__init__()
        if not (torch.equal(kernel, kernel.T) and torch.equal(kernel, kernel.flip(0))):
            raise ParameterError("kernel: the blur filter must be symmetric under 90-degree rotations and flips")
        self.stride, self.padding, self.pad_mode = stride, padding, pad_mode
        self.register_buffer("kernel", kernel.detach().clone()[None, None], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, [self.padding] * 4, mode=self.pad_mode)
        weight = self.kernel.to(x.dtype).expand(x.shape[1], 1, *self.kernel.shape[-2:])
        return F.conv2d(x, weight, stride=self.stride, groups=x.shape[1])

    def extra_repr(self) -> str:
        return f"kernel={self.kernel.shape[-1]}, stride={self.stride}, padding={self.padding}, mode={self.pad_mode}"
