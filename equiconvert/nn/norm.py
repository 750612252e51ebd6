"""Per-sample normalisation over whole fields: no batch statistics, equivariant."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def largest_divisor_at_most(n: int, bound: int) -> int:
    return max(d for d in range(1, min(n, bound) + 1) if n % d == 0)


class FieldGroupNorm(nn.Module):
    """GroupNorm whose groups are unions of whole fields, with affine parameters tied per field.

    Statistics are taken per sample over every channel of a group of fields and
    all positions, so they are invariant under the group and never mix samples
    (which is what makes DP-SGD legal). A constant scale and shift per field
    commutes with permutations of a regular field and with trivial fields.
    """

    def __init__(self, num_fields: int, field_size: int, num_groups: int, affine: bool = True, eps: float = 1e-5):
        super().__init__()
        if num_fields % num_groups:
            raise ValueError(f"num_groups={num_groups} must divide num_fields={num_fields}")
        self.num_fields, self.field_size, self.num_groups, self.eps = num_fields, field_size, num_groups, eps
        self.weight = nn.Parameter(torch.ones(num_fields)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_fields)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.repeat_interleave(self.field_size)
        bias = None if self.bias is None else self.bias.repeat_interleave(self.field_size)
        return F.group_norm(x, self.num_groups, weight, bias, self.eps)

    def extra_repr(self) -> str:
        return (
            f"fields={self.num_fields}x{self.field_size}, num_groups={self.num_groups}, "
            f"affine={self.weight is not None}, eps={self.eps}"
        )
