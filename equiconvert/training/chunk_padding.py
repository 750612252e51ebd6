"""Blank rows that bring each physical batch to a multiple of a fixed size, and a loss that gives them no gradient.

With Poisson sampling a step's last physical batch has a new size almost every step, so cuDNN's autotuning (which
tunes once per input shape) would tune hundreds of shapes. Padded to a multiple of `physical_batch_multiple` rows,
a run sees a handful. A blank row is an all-zero example labelled PADDING_LABEL, added after the augmentation (so
the real examples draw the same crops and flips as without padding). Its loss is replaced by zero through
torch.where, whose backward sends it exactly zero, so its per-example gradient is exactly zero and, clipped, summed
and noised with the real examples', changes nothing. The step's count and divisor stay those of the real examples.
"""

from __future__ import annotations

import torch

from ..privacy.per_sample_method import PerExampleLoss

PADDING_LABEL = -1  # never a class index: check_labels refuses negative labels


def padded_size(rows: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that holds `rows` rows."""
    return -(-rows // multiple) * multiple


def pad_with_blank_rows(
    examples: torch.Tensor, labels: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """examples (B, ...) (the trainer passes each example's views, (B, K, C, H, W)) and labels (B,), with all-zero
    rows labelled PADDING_LABEL appended up to a multiple of `multiple`."""
    missing = padded_size(len(labels), multiple) - len(labels)
    if missing == 0:
        return examples, labels
    blank_examples = examples.new_zeros((missing, *examples.shape[1:]))
    blank_labels = labels.new_full((missing,), PADDING_LABEL)
    return torch.cat([examples, blank_examples]), torch.cat([labels, blank_labels])


def ignoring_blank_rows(loss_fn: PerExampleLoss) -> PerExampleLoss:
    """loss_fn whose loss (and so gradient) is exactly zero on PADDING_LABEL rows; loss_fn sees class 0 there."""

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        real = labels != PADDING_LABEL
        losses = loss_fn(logits, torch.where(real, labels, torch.zeros_like(labels)))
        return torch.where(real, losses, torch.zeros_like(losses))

    return loss
