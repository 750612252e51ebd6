"""Layer scale (a learned per-channel gain) with one gain per field."""

from __future__ import annotations

import torch
from torch import nn


class FieldLayerScale(nn.Module):
    """x * gamma with gamma constant over each field: a per-channel gain inside a regular field would not commute
    with its channel permutations. `channels_last` selects (B, H, W, C) inputs."""

    def __init__(self, num_fields: int, field_size: int, init_value: float = 1e-6, channels_last: bool = False) -> None:
        super().__init__()
        self.num_fields, self.field_size, self.channels_last = num_fields, field_size, channels_last
        self.gamma = nn.Parameter(torch.full((num_fields,), float(init_value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gain = self.gamma.repeat_interleave(self.field_size)
        return x * (gain if self.channels_last else gain.reshape(-1, *(1,) * (x.ndim - 2)))

    def extra_repr(self) -> str:
        return f"fields={self.num_fields}x{self.field_size}, channels_last={self.channels_last}"
