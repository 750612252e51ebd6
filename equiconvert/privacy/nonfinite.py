"""Non-finite per-example gradients become zero: a valid clipped value, so the privacy bound holds.

A NaN in one example's gradient would otherwise turn the clipped sum, and with it every
weight, into NaN (NaN times a clip factor of 0 is still NaN). Zero is what clipping could
have produced, so replacing it changes no sensitivity; the DP step (dp_step.py), which both
front-ends call, zeroes such examples here and keeps a count on the device. The count is a
noise-free statistic of the training data: neither prints nor writes it by default.
"""

from __future__ import annotations

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
