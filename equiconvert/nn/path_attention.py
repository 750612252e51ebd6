"""Attention over parallel paths on fields: selective kernels (SKNet) and split attention (ResNeSt)."""

from __future__ import annotations

import torch
from torch import nn


class FieldPathAttention(nn.Module):
    """sum_p a_p * x_p, with a_p one weight per field from group-pooled (invariant) statistics of sum_p x_p.

    SKNet and ResNeSt weight each channel of each path by a softmax over the paths computed from
    the pooled channels; weighting single channels of a regular field would break equivariance.
    Here the statistics are spatial and group means per field, the MLP on them is per sample
    (a GroupNorm in place of a batch norm), and each weight scales a whole field of a path, so the
    result commutes with the group. One path uses a sigmoid gate, as ResNeSt does with radix 1.
    """

    def __init__(self, paths: int, num_fields: int, field_size: int, hidden: int, act: nn.Module, norm: bool) -> None:
        super().__init__()
        self.paths, self.num_fields, self.field_size = paths, num_fields, field_size
        self.fc1 = nn.Linear(num_fields, hidden)
        self.norm = nn.GroupNorm(1, hidden) if norm else nn.Identity()
        self.act = act
        self.fc2 = nn.Linear(hidden, paths * num_fields)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        """xs: `paths` maps of num_fields * field_size channels, or one map holding the paths one after another."""
        x = torch.stack(xs, 1) if len(xs) > 1 else xs[0].reshape(xs[0].shape[0], self.paths, -1, *xs[0].shape[2:])
        batch, _, channels, height, width = x.shape
        fields = x.reshape(batch, self.paths, self.num_fields, self.field_size, height, width)
        stats = fields.sum(1).mean((2, 3, 4))  # (B, F), invariant
        logits = self.fc2(self.act(self.norm(self.fc1(stats)))).reshape(batch, self.paths, self.num_fields)
        weights = torch.softmax(logits, 1) if self.paths > 1 else torch.sigmoid(logits)
        return (fields * weights[..., None, None, None]).sum(1).reshape(batch, channels, height, width)

    def extra_repr(self) -> str:
        return f"paths={self.paths}, fields={self.num_fields}x{self.field_size}, hidden={self.fc1.out_features}"
