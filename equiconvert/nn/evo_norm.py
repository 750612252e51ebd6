"""EvoNorm-S on fields: per-sample statistics over groups of whole fields, parameters tied per field."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ParameterError
from .norm import at_least_fp32

STATISTICS = ("std", "rms")


class FieldEvoNorm(nn.Module):
    """x -> (gate(x) / d(x) if normalize else x) * weight + bias, per field.

    d is the standard deviation ("std", EvoNorm S0/S1) or the root mean square ("rms", S2) of
    each sample's group of whole fields over all its channels and positions: invariant under
    the group, and never across samples. gate is x * sigmoid(v x) (S0, `swish_gain` v per
    field), or an elementwise activation (S1, S2), or the identity. Everything is constant
    within a field, so it commutes with permutations of regular fields and with trivial ones.
    """

    def __init__(
        self,
        num_fields: int,
        field_size: int,
        num_groups: int,
        statistic: str,
        normalize: bool,
        activation: nn.Module | None,
        swish_gain: bool,
        eps: float,
    ) -> None:
        super().__init__()
        if statistic not in STATISTICS or num_fields % num_groups:
            raise ParameterError(
                f"statistic must be one of {STATISTICS} and num_groups={num_groups} must divide num_fields={num_fields}"
            )
        self.num_fields, self.field_size, self.num_groups = num_fields, field_size, num_groups
        self.statistic, self.normalize, self.eps = statistic, normalize, eps
        self.activation = activation if activation is not None else nn.Identity()
        self.v = nn.Parameter(torch.ones(num_fields)) if swish_gain else None
        self.weight = nn.Parameter(torch.ones(num_fields))
        self.bias = nn.Parameter(torch.zeros(num_fields))

    def _per_channel(self, p: torch.Tensor) -> torch.Tensor:
        return p.repeat_interleave(self.field_size).view(1, -1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.normalize:
            grouped = at_least_fp32(x).reshape(x.shape[0], self.num_groups, -1)
            if self.statistic == "rms":
                spread = grouped.square().mean(-1, keepdim=True)
            else:
                spread = grouped.var(-1, unbiased=False, keepdim=True)
            d = (spread + self.eps).sqrt().to(x.dtype).expand(grouped.shape).reshape(x.shape)
            gated = x * torch.sigmoid(x * self._per_channel(self.v)) if self.v is not None else self.activation(x)
            x = gated / d
        return x * self._per_channel(self.weight) + self._per_channel(self.bias)

    def extra_repr(self) -> str:
        return (
            f"fields={self.num_fields}x{self.field_size}, groups={self.num_groups}, {self.statistic}, "
            f"normalize={self.normalize}, swish_gain={self.v is not None}"
        )
