"""Pooling over the group dimension of each field: the step that makes features invariant."""

from __future__ import annotations

import functools
import math
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

_SCALE_KEY = "_extra_state"  # torch's key suffix for get_extra_state


@functools.cache
def _mean_square_of_max(n: int, steps: int = 8001, bound: float = 10.0) -> float:
    """E[max(Z_1..Z_n)^2] for i.i.d. standard normal Z (trapezoid rule on the density n phi Phi^(n-1))."""
    if n == 1:  # the identity: exactly 1, so a trivial group's pooling stays exact
        return 1.0
    h = 2 * bound / (steps - 1)
    total = 0.0
    for i in range(steps):
        x = -bound + i * h
        density = (
            n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
        )
        total += x * x * density * (0.5 if i in (0, steps - 1) else 1.0)
    return total * h


# group pooling mode -> E[out^2] of its reduction over n i.i.d. standard normal components
MEAN_SQUARES: dict[str, Callable[[int], float]] = {
    "max": _mean_square_of_max,
    "mean": lambda n: 1.0 / n,
    "norm": lambda n: float(n),
}


def unit_scale(mode: str, field_size: int) -> float:
    """The factor that gives the invariants of unit-variance fields unit RMS, as the channels they replace have.

    A max over a field's |G| channels, or the norm of its components, grows with the field (a norm of 9
    components is 3x its input): the classifier after it would start with logits and a learning rate
    that many times the original's.
    """
    return MEAN_SQUARES[mode](field_size) ** -0.5


class InvariantScale(nn.Module):
    """An invariant map's output factor `scale`, kept in the state_dict (as extra state) so that a saved model
    rebuilds the function it was trained as; a state_dict without it was saved unscaled (scale 1)."""

    scale: float

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([self.scale], dtype=torch.float64)

    def set_extra_state(self, state) -> None:
        """Read in _load_from_state_dict, which also handles a state_dict without it."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        key = prefix + _SCALE_KEY
        saved = state_dict.get(key)
        if isinstance(saved, torch.Tensor) and saved.numel() == 1:
            self.scale = float(saved)
        elif saved is None:  # saved before invariant maps were scaled
            self.scale = 1.0
            state_dict[key] = self.get_extra_state()
        else:
            errors.append(f"{prefix.rstrip('.')}: {key} must be a one-element tensor (the output scale)")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)

    def scaled(self, invariants: torch.Tensor) -> torch.Tensor:
        return invariants if self.scale == 1.0 else invariants * self.scale


class GroupPool(InvariantScale):
    """Reduce each field of `field_size` channels to one invariant channel, times `scale`.

    Works on (B, C, ...) tensors with C = num_fields * field_size. Any symmetric
    reduction is invariant under the channel permutations of a regular field.
    """

    def __init__(self, num_fields: int, field_size: int, mode: str = "max", scale: float = 1.0) -> None:
        super().__init__()
        if mode not in GROUP_POOL_MODES:
            raise ParameterError(f"mode={mode!r}: unknown group pooling mode; use one of {GROUP_POOL_MODES}")
        if not scale > 0:
            raise ParameterError(f"scale={scale!r}: group pooling's scale must be positive")
        self.num_fields, self.field_size, self.mode, self.scale = num_fields, field_size, mode, float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fields = x.reshape(x.shape[0], self.num_fields, self.field_size, *x.shape[2:])
        return self.scaled(REDUCTIONS[self.mode](fields))

    def extra_repr(self) -> str:
        scale = f", scale={self.scale:.6g}" if self.scale != 1.0 else ""
        return f"fields={self.num_fields}x{self.field_size}, mode={self.mode}{scale}"
