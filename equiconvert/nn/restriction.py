"""Restriction to a subgroup: a fixed change of basis on the fields (a channel permutation, or Hadamard pairs)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ParameterError


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
            raise ParameterError(f"field_index must be a permutation of 0..{size - 1}, got {field_index}")
        self.num_fields, self.field_size = num_fields, size
        offsets = torch.arange(num_fields).repeat_interleave(size) * size
        self.register_buffer("index", offsets + torch.tensor(field_index).repeat(num_fields), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(1, self.index)

    def extra_repr(self) -> str:
        return f"fields={self.num_fields}x{self.field_size}"


class ReflectionRestriction(nn.Module):
    """Restrict fields on which the flip acts diagonally (+1/-1 per channel) to regular D1 fields.

    `pairs` lists, for one input field, the D1 fields it becomes: (a, b) with the flip
    fixing channel a and negating channel b. Each becomes the regular D1 field
    ((a + b), (a - b)) / sqrt(2): the orthogonal Hadamard change of basis, after which
    the flip swaps the two channels, as it does on a regular field.

    A fixed channel with no negated partner (b = None; O(2)'s gates) becomes (a, a) / sqrt(2),
    the isometric embedding of the trivial representation into the regular one. That
    keeps one field type (regular D1 fields) for everything after the restriction, so
    every D_N layer applies unchanged, drops nothing and stays exactly equivariant: both
    channels are computed as a + b and a - b with b = +-x or 0, so the flip swaps them
    bit for bit. The price: such a field has no sign part, so the half of the next conv's
    filter space that reads it from those fields is unused (zero gradient): for O(2),
    whose fields have as many gates as pairs, a quarter of that conv's coefficients.
    The map is linear, has no parameters, and is an isometry, so per-sample gradients
    and norms pass through it unchanged.
    """

    def __init__(self, num_fields: int, field_size: int, pairs: tuple[tuple[int, int | None], ...]) -> None:
        super().__init__()
        used = [c for pair in pairs for c in pair if c is not None]
        if sorted(used) != list(range(field_size)):
            raise ParameterError(f"pairs must use every channel 0..{field_size - 1} exactly once, got {pairs}")
        self.num_fields, self.field_size, self.out_fields = num_fields, field_size, num_fields * len(pairs)
        offsets = torch.arange(num_fields).repeat_interleave(len(pairs)) * field_size
        fixed = torch.tensor([a for a, _ in pairs]).repeat(num_fields) + offsets
        # unpaired: index num_fields * field_size, the zero channel appended in forward
        negated = torch.tensor([-1 if b is None else b for _, b in pairs]).repeat(num_fields) + offsets
        negated[torch.tensor([b is None for _, b in pairs]).repeat(num_fields)] = num_fields * field_size
        self.register_buffer("fixed", fixed, persistent=False)
        self.register_buffer("negated", negated, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.index_select(1, self.fixed)
        b = torch.cat([x, torch.zeros_like(x.narrow(1, 0, 1))], 1).index_select(1, self.negated)
        return torch.stack([a + b, a - b], 2).flatten(1, 2) * 0.5**0.5

    def extra_repr(self) -> str:
        return f"fields={self.num_fields}x{self.field_size} -> {self.out_fields}x2 (D1 regular)"
