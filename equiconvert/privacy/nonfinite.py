"""Non-finite per-example gradients become zero: a valid clipped value, so the privacy bound holds.

A NaN in one example's gradient would otherwise turn the clipped sum, and with it every
weight, into NaN (NaN times a clip factor of 0 is still NaN). Zero is what clipping could
have produced, so replacing it changes no sensitivity; the DP trainer and make_private's
optimizer both zero such examples here, count them and report the total.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Mapping
from typing import TypeVar

import torch

Key = TypeVar("Key", bound=Hashable)  # a parameter name (the trainer) or the parameter itself (DPOptimizer)


def zero_nonfinite_examples(
    gradients: Mapping[Key, torch.Tensor],
) -> tuple[dict[Key, torch.Tensor], torch.Tensor | int]:
    """The gradients with every example that has any non-finite entry set to zero, and how many there were.

    The count stays a device tensor and the zeroing is unconditional, so that a step never waits for the device.
    """
    if not gradients:
        return dict(gradients), 0
    finite = torch.stack([torch.isfinite(g.reshape(g.shape[0], -1)).all(dim=1) for g in gradients.values()]).all(dim=0)
    cleaned = {
        key: torch.where(finite.view(-1, *([1] * (g.dim() - 1))), g, torch.zeros((), dtype=g.dtype, device=g.device))
        for key, g in gradients.items()
    }
    return cleaned, (~finite).sum()


class NonfiniteCount:
    """A running count of zeroed examples, kept on the device, that warns once when the host first sees one.

    On CPU the count is read directly. On an accelerator the host reads a non-blocking copy
    once the device has reached it (an event's query), so no step waits for the device and
    the warning may come a few steps after the example.
    """

    def __init__(self, device: torch.device, warning: str) -> None:
        self._total = torch.zeros((), dtype=torch.int64, device=device)
        self._warning = warning
        self._warned = False
        self._host: torch.Tensor | None = None  # pinned copy of the total, valid once _copied has completed
        self._copied: torch.Event | None = None

    def add(self, count: torch.Tensor | int) -> None:
        """Add one batch's count (a device tensor); warn if the host can already see a non-zero total."""
        self._total += count
        if self._warned:
            return
        if self._total.device.type == "cpu":
            self._warn_if_seen(int(self._total), stacklevel=5)
            return
        if self._copied is not None:
            if not self._copied.query():
                return
            self._warn_if_seen(int(self._host), stacklevel=5)
            if self._warned:
                return
        if self._host is None:
            self._host = torch.zeros((), dtype=torch.int64, pin_memory=True)
        self._host.copy_(self._total, non_blocking=True)
        self._copied = torch.Event(device=self._total.device)
        self._copied.record()

    def total(self) -> int:
        """The count so far (waits for the device)."""
        total = int(self._total)
        self._warn_if_seen(total, stacklevel=4)
        return total

    def _warn_if_seen(self, total: int, stacklevel: int) -> None:
        """stacklevel: of the user's code (the optimizer's step, or the property that reads the count)."""
        if total and not self._warned:
            self._warned = True
            warnings.warn(self._warning, RuntimeWarning, stacklevel=stacklevel)
