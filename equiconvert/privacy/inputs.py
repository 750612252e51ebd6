"""Checks of the tensors given to DPTrainer: refused before any step, naming the first bad index.

A NaN pixel makes every weight NaN after one step, and a bad label fails deep inside
the loss (or, on CUDA, as a device assert); both are caught here instead.
"""

from __future__ import annotations

import torch

from ..errors import EquiconvertError


class InvalidDataError(EquiconvertError, ValueError):
    """Images or labels given for training or evaluation cannot be used."""


def check_images(images: torch.Tensor, what: str) -> None:
    """Floating-point images must be finite everywhere; the error names the first bad example."""
    if not isinstance(images, torch.Tensor) or images.dim() < 2:
        raise InvalidDataError(f"{what} images must be a tensor (N, C, H, W), got {type(images).__name__}")
    if images.is_floating_point() or images.is_complex():
        finite = torch.isfinite(images.reshape(images.shape[0], -1)).all(dim=1)
        if not bool(finite.all()):
            index = int((~finite).nonzero()[0])
            raise InvalidDataError(
                f"{what} images[{index}] holds a non-finite value (NaN or inf) "
                f"({int((~finite).sum())} such examples): clean or drop them first"
            )


def check_labels(labels: torch.Tensor, num_images: int, num_classes: int, what: str) -> None:
    """Labels: integer class indices in [0, num_classes), one per image."""
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1:
        raise InvalidDataError(f"{what} labels must be a 1-D tensor of class indices")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise InvalidDataError(f"{what} labels have dtype {labels.dtype}; give integer class indices (torch.long)")
    if labels.shape[0] != num_images:
        raise InvalidDataError(f"{what} has {num_images} images but {labels.shape[0]} labels: give one label per image")
    if labels.numel() == 0:
        return
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= num_classes:
        index = int(((labels < 0) | (labels >= num_classes)).nonzero()[0])
        raise InvalidDataError(
            f"{what} labels[{index}] = {int(labels[index])} is outside [0, {num_classes}), the "
            f"model's {num_classes} outputs (labels span [{low}, {high}])"
        )
