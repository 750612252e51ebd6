"""Pooling over the group dimension of each field: the step that makes features invariant."""

from __future__ import annotations

import torch
from torch import nn

GROUP_POOL_MODES = ("max", "mean", "norm")


class GroupPool(nn.Module):
    """Reduce each field of `field_size` channels to one invariant channel.

    Works on (B, C, ...) tensors with C = num_fields * field_size. Any symmetric
    reduction is invariant under the channel permutations of a regular field.
    """

    def __init__(self, num_fields: int, field_size: int, mode: str = "max") -> None:
        super().__init__()
        if mode not in GROUP_POOL_MODES:
            raise ValueError(f"group pooling mode {mode!r} unknown; use one of {GROUP_POOL_MODES}")
        self.num_fields, self.field_size, self.mode = num_fields, field_size, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fields = x.reshape(x.shape[0], self.num_fields, self.field_size, *x.shape[2:])
        if self.mode == "max":
            return fields.amax(dim=2)
        if self.mode == "mean":
            return fields.mean(dim=2)
        return fields.pow(2).sum(dim=2).add(1e-12).sqrt()

    def extra_repr(self) -> str:
        return f"fields={self.num_fields}x{self.field_size}, mode={self.mode}"
