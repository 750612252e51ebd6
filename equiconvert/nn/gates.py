"""Channel-attention gates on fields: ECA's 1D convolution over per-field invariant statistics."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FieldEcaGate(nn.Module):
    """x * sigmoid(conv1d(s)) per field, with s the spatial and group mean of each field (invariant).

    ECA convolves across neighbouring channels, which would mix the channels of a regular field
    unevenly; here it convolves across neighbouring fields and scales every channel of a field
    by the same gate, which commutes with the group. `circular` pads the field axis circularly (CECA).
    """

    def __init__(self, num_fields: int, field_size: int, kernel_size: int, circular: bool = False) -> None:
        super().__init__()
        self.num_fields, self.field_size, self.circular = num_fields, field_size, circular
        self.weight = nn.Parameter(torch.empty(1, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = x.mean((2, 3)).reshape(x.shape[0], 1, self.num_fields, self.field_size).mean(-1)  # (B, 1, F)
        pad = (self.weight.shape[-1] - 1) // 2
        if self.circular:
            gate = F.conv1d(F.pad(stats, (pad, pad), mode="circular"), self.weight)
        else:
            gate = F.conv1d(stats, self.weight, padding=pad)
        gate = torch.sigmoid(gate).reshape(x.shape[0], self.num_fields, 1, 1, 1)
        return (x.reshape(x.shape[0], self.num_fields, self.field_size, *x.shape[2:]) * gate).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"fields={self.num_fields}x{self.field_size}, kernel={self.weight.shape[-1]}, circular={self.circular}"
