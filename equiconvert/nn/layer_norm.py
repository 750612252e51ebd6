"""Per-pixel layer norm over all channels with its affine map tied per field (ConvNeXt's LayerNorm2d)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FieldLayerNorm(nn.Module):
    """Standardize each pixel over all its channels; scale and shift one value per field.

    The mean and variance over all channels of a pixel are invariant under the channel
    permutations of regular fields (and the rotation of the grid only moves pixels), so
    the standardization commutes with the group; a per-field affine map does too.
    `channels_last` selects (B, H, W, C) inputs instead of (B, C, H, W).
    """

    def __init__(
        self, num_fields: int, field_size: int, affine: bool = True, eps: float = 1e-5, channels_last: bool = False
    ) -> None:
        super().__init__()
        self.num_fields, self.field_size, self.eps, self.channels_last = num_fields, field_size, eps, channels_last
        self.weight = nn.Parameter(torch.ones(num_fields)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_fields)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = self.num_fields * self.field_size
        weight = None if self.weight is None else self.weight.repeat_interleave(self.field_size)
        bias = None if self.bias is None else self.bias.repeat_interleave(self.field_size)
        if self.channels_last:
            return F.layer_norm(x, (channels,), weight, bias, self.eps)
        y = F.layer_norm(x.movedim(1, -1), (channels,), weight, bias, self.eps)
        return y.movedim(-1, 1)

    def extra_repr(self) -> str:
        return (
            f"fields={self.num_fields}x{self.field_size}, affine={self.weight is not None}, eps={self.eps}, "
            f"channels_last={self.channels_last}"
        )
