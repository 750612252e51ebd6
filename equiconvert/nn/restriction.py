"""Restriction to a subgroup: a fixed change of basis on the fields, applied as a channel permutation."""
from __future__ import annotations

import torch
from torch import nn


class FieldRestriction(nn.Module):
    """Reorder the channels of each field so that it reads as fields of a subgroup.

    Restricting a regular field of G to a subgroup H splits it into |G:H| regular
    fields of H (one per coset): no arithmetic, only a permutation, so it is exact,
    has no parameters, and per-sample gradients pass through it unchanged.
    `field_index` is the order of one field's channels; trivial fields use (0,).
    """

    def __init__(self, num_fields: int, field_index: tuple[int, ...]) -> None:
        super().__init__()
        size = len(field_index)
        if sorted(field_index) != list(range(size)):
            raise ValueError(f"field_index must be a permutation of 0..{size - 1}, got {field_index}")
        self.num_fields, self.field_size = num_fields, size
        offsets = torch.arange(num_fields).repeat_interleave(size) * size
        self.register_buffer("index", offsets + torch.tensor(field_index).repeat(num_fields), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(1, self.index)

    def extra_repr(self) -> str:
        return f"fields={self.num_fields}x{self.field_size}"
