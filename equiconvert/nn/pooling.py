"""Pooling over the group dimension of each field: the step that makes features invariant."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..errors import ParameterError

NORM_POOL_EPS = 1e-12  # 'norm' takes sqrt(sum x^2 + eps): a zero field gives 1e-6 and a finite gradient


def _max(fields: torch.Tensor) -> torch.Tensor:
    return fields.amax(dim=2)


def _mean(fields: torch.Tensor) -> torch.Tensor:
    return fields.mean(dim=2)


def _norm(fields: torch.Tensor) -> torch.Tensor:
    return fields.pow(2).sum(dim=2).add(NORM_POOL_EPS).sqrt()


# group pooling mode -> reduction of a (B, fields, field size, ...) tensor over its field-size dim
REDUCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"max": _max, "mean": _mean, "norm": _norm}
GROUP_POOL_MODES = tuple(REDUCTIONS)


class GroupPool(nn.Module):
    """Reduce each field of `field_size` channels to one invariant channel.

    Works on (B, C, ...) tensors with C = num_fields * field_size. Any symmetric
    reduction is invariant under the channel permutations of a regular field.
    """

    def __init__(self, num_fields: int, field_size: int, mode: str = "max") -> None:
        super().__init__()
        if mode not in GROUP_POOL_MODES:
            raise ParameterError(f"mode={mode!r}: unknown group pooling mode; use one of {GROUP_POOL_MODES}")
        self.num_fields, self.field_size, self.mode = num_fields, field_size, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return REDUCTIONS[self.mode](x.reshape(x.shape[0], self.num_fields, self.field_size, *x.shape[2:]))

    def extra_repr(self) -> str:
        return f"fields={self.num_fields}x{self.field_size}, mode={self.mode}"
