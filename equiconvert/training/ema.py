"""Exponential moving average of the weights (De et al. 2022), evaluated instead of the raw weights.

DP-SGD iterates are noisy; averaging them is post-processing, so it improves
accuracy at no privacy cost. De et al. warm the decay up so that early, far
from converged iterates are forgotten quickly:
decay_t = min(decay, (1 + t) / (10 + t)).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..errors import NameMismatchError, ParameterError
from .dp_config import DEFAULT_EMA_DECAY

Target = nn.Module | Mapping[str, torch.Tensor]


def warmup_cap(step: int) -> float:
    """De et al.'s bound on the decay at optimisation step `step` (0-based): (1 + t) / (10 + t)."""
    return (1.0 + step) / (10.0 + step)


def _tensors(target: Target) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters, buffers) by name; a mapping (torch.func-style params dict) counts as parameters only."""
    if isinstance(target, nn.Module):
        return dict(target.named_parameters()), dict(target.named_buffers())
    return dict(target), {}


def _check_names(kind: str, mine: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor]) -> None:
    if mine.keys() != theirs.keys():
        missing, extra = sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys())
        raise NameMismatchError(f"EMA {kind} do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")


class ExponentialMovingAverage:
    """Shadow copy of a model's parameters (averaged) and buffers (copied as they are).

    The model's tensors are only ever written in place (`copy_`), so a
    torch.func training loop that holds references to them (e.g. a params dict
    for `functional_call`) stays valid across `copy_to` and `applied`.
    """

    def __init__(self, model: Target, decay: float = DEFAULT_EMA_DECAY) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ParameterError(f"decay must be in [0, 1], got {decay}")
        self.decay = float(decay)
        self.num_updates = 0
        params, buffers = _tensors(model)
        self.params = {name: tensor.detach().clone() for name, tensor in params.items()}
        self.buffers = {name: tensor.detach().clone() for name, tensor in buffers.items()}

    def decay_at(self, step: int) -> float:
        """De et al.'s warmed-up decay for optimisation step `step` (0-based)."""
        return min(self.decay, warmup_cap(step))

    def unreached_warning(self, steps: int) -> str | None:
        """Why the decay asked for never applies in a run of `steps` steps, or None when it does.

        The warm-up cap (1 + t) / (10 + t) passes `decay` only after (10 decay - 1) / (1 - decay) steps (1,790 for
        0.995, 8,990 for 0.999): in a shorter run every decay above the last step's cap trains the same EMA.
        """
        if steps < 1 or self.decay_at(steps - 1) >= self.decay:
            return None
        needed = math.ceil((10.0 * self.decay - 1.0) / (1.0 - self.decay))
        return (
            f"EMA decay {self.decay:g} is never reached in {steps} steps: De et al.'s warm-up caps step t's decay "
            f"at (1 + t) / (10 + t), {warmup_cap(steps - 1):.4f} at the last step, and {self.decay:g} needs "
            f"{needed} steps; every decay above {warmup_cap(steps - 1):.4f} gives this run the same EMA"
        )

    @torch.no_grad()
    def update(self, model: Target, step: int) -> None:
        """ema <- d * ema + (1 - d) * param with d = decay_at(step); buffers are copied."""
        params, buffers = _tensors(model)
        _check_names("parameters", self.params, params)
        weight = 1.0 - self.decay_at(step)
        for name, shadow in self.params.items():
            shadow.lerp_(params[name].detach().to(shadow.dtype), weight)
        for name, buffer in buffers.items():
            if name in self.buffers:
                self.buffers[name].copy_(buffer)
        self.num_updates += 1

    @torch.no_grad()
    def copy_to(self, model: Target) -> None:
        """Overwrite the model's parameters (and buffers) with the EMA ones, in place."""
        params, buffers = _tensors(model)
        _check_names("parameters", self.params, params)
        for name, shadow in self.params.items():
            params[name].copy_(shadow)
        for name, buffer in buffers.items():
            if name in self.buffers:
                buffer.copy_(self.buffers[name])

    @contextmanager
    def applied(self, model: Target) -> Iterator[Target]:
        """Evaluate with EMA weights inside the block; the training weights come back afterwards, even on error."""
        params, buffers = _tensors(model)
        with torch.no_grad():
            saved_params = {name: tensor.detach().clone() for name, tensor in params.items()}
            saved_buffers = {name: tensor.detach().clone() for name, tensor in buffers.items()}
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for name, tensor in saved_params.items():
                    params[name].copy_(tensor)
                for name, tensor in saved_buffers.items():
                    buffers[name].copy_(tensor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "decay": self.decay,
            "num_updates": self.num_updates,
            "params": {name: tensor.clone() for name, tensor in self.params.items()},
            "buffers": {name: tensor.clone() for name, tensor in self.buffers.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy a saved state into the existing shadow tensors, so they stay on this EMA's device."""
        _check_names("parameters", self.params, state["params"])
        _check_names("buffers", self.buffers, state["buffers"])
        self.decay = float(state["decay"])
        self.num_updates = int(state["num_updates"])
        for name, tensor in state["params"].items():
            self.params[name].copy_(tensor)
        for name, tensor in state["buffers"].items():
            self.buffers[name].copy_(tensor)
