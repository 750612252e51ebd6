"""Blank rows that bring each physical batch to a multiple of a fixed size, and a loss that gives them no gradient.

With Poisson sampling a step's last physical batch has a new size almost every step, so cuDNN's autotuning (which
tunes once per input shape) would tune hundreds of shapes. Padded to a multiple of `physical_batch_multiple` rows,
a run sees a handful. A blank row is an all-zero example labelled PADDING_LABEL, added after the augmentation (so
the real examples draw the same crops and flips as without padding). Its loss is replaced by zero through
torch.where, so the step's loss is the real examples'. Its gradient is not trusted to be zero: on an all-zero input
a model may be NaN, and the backward's 0 * NaN is NaN. The DP step is told which rows are real (real_rows) and
zeroes the others' gradients and never counts them as non-finite (privacy/nonfinite.py): that count is stored, and
would otherwise reveal the padding and so the secret batch size. The step's count and divisor stay the real ones.
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


def real_rows(labels: torch.Tensor) -> torch.Tensor:
    """Which rows are examples (B,) bool: False on the blank rows pad_with_blank_rows appended."""
    return labels != PADDING_LABEL


def ignoring_blank_rows(loss_fn: PerExampleLoss) -> PerExampleLoss:
    """loss_fn whose loss, and its gradient in the logits, is exactly zero on PADDING_LABEL rows; loss_fn sees class 0
    there."""

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        real = real_rows(labels)
        losses = loss_fn(logits, torch.where(real, labels, torch.zeros_like(labels)))
        return torch.where(real, losses, torch.zeros_like(losses))

    return loss
