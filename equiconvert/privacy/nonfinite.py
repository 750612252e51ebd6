"""Non-finite per-example gradients become zero: a valid clipped value, so the privacy bound holds.

A NaN in one example's gradient would otherwise turn the clipped sum, and with it every
weight, into NaN. Zero is what clipping could have produced, so replacing it changes no
sensitivity; the trainer counts such examples and reports the total.
"""

from __future__ import annotations

import torch

Gradients = dict[str, torch.Tensor]


def zero_nonfinite_examples(gradients: Gradients) -> tuple[Gradients, torch.Tensor | int]:
    """The gradients with every example that has any non-finite entry set to zero, and how many there were.

    The count stays a device tensor and the zeroing is unconditional, so that a step never waits for the device.
    """
    if not gradients:
        return gradients, 0
    finite = torch.stack([torch.isfinite(g.reshape(g.shape[0], -1)).all(dim=1) for g in gradients.values()]).all(dim=0)
    cleaned = {
        name: torch.where(finite.view(-1, *([1] * (g.dim() - 1))), g, torch.zeros((), dtype=g.dtype, device=g.device))
        for name, g in gradients.items()
    }
    return cleaned, (~finite).sum()
