"""Non-finite per-example gradients become zero: a valid clipped value, so the privacy bound holds.

A NaN in one example's gradient would otherwise turn the clipped sum, and with it every
weight, into NaN (NaN times a clip factor of 0 is still NaN). Zero is what clipping could
have produced, so replacing it changes no sensitivity; the DP step (dp_step.py), which both
front-ends call, zeroes such examples here and keeps a count on the device. The count is a
noise-free statistic of the training data: neither prints nor writes it by default. A blank row that pads a
physical batch (training/chunk_padding.py) adds zero and is never counted, whatever its gradient: counted, it
would reveal how many rows padded the batch, and so the secret batch size.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TypeVar

import torch

Key = TypeVar("Key", bound=Hashable)  # a parameter name (the trainer) or the parameter itself (DPOptimizer)


def kept_and_nonfinite(finite: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """From whether each row's gradient is finite (B,): the rows that add their gradient (finite examples) and how
    many examples were non-finite (a device tensor). `real` (B,): False on blank rows, which neither add nor count;
    None: every row is an example."""
    if real is None:
        return finite, (~finite).sum()
    return finite & real, (real & ~finite).sum()


def zero_nonfinite_examples(
    gradients: Mapping[Key, torch.Tensor], real: torch.Tensor | None = None
) -> tuple[dict[Key, torch.Tensor], torch.Tensor | int]:
    """The gradients with every example that has any non-finite entry, and every blank row (`real` False), set to
    zero, and how many examples were non-finite (kept_and_nonfinite).

    The count stays a device tensor and the zeroing is unconditional, so that a step never waits for the device.
    """
    if not gradients:
        return dict(gradients), 0
    finite = torch.stack([torch.isfinite(g.reshape(g.shape[0], -1)).all(dim=1) for g in gradients.values()]).all(dim=0)
    kept, nonfinite = kept_and_nonfinite(finite, real)
    cleaned = {
        key: torch.where(kept.view(-1, *([1] * (g.dim() - 1))), g, torch.zeros((), dtype=g.dtype, device=g.device))
        for key, g in gradients.items()
    }
    return cleaned, nonfinite
