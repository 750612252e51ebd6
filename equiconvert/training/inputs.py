"""Checks of the tensors given to DPTrainer: refused before any step, naming the first bad index.

A NaN pixel makes every weight NaN after one step, and a bad label fails deep inside
the loss (or, on CUDA, as a device assert); both are caught here instead.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from ..errors import DataError
from ..image_shape import ImageShapeError, first_conv_channels, image_shape_message


class InvalidDataError(DataError, ValueError):
    """Images or labels given for training or evaluation cannot be used."""


PIXEL_TOLERANCE = 1e-3  # float images in [0, 1] up to rounding
# the largest magnitude float images may have: normalised pixels, (x - mean) / std with x in [0, 1], stay within it
# unless a channel's std is below 1/32; pixels in [0, 255] exceed it unless the images are nearly black
NORMALISED_LIMIT = 32.0


def check_images(images: torch.Tensor, what: str) -> None:
    """Images DPTrainer can read: uint8 pixels, or finite floats that are pixels in [0, 1] or already normalised.

    The trainer reads uint8 as pixel / 255 and any float as is, then applies normalize_mean/normalize_std: float
    pixels in [0, 255] or integer images of another dtype would train on a scale 255 times too large, so they are
    refused (_refuse_pixel_scale says how they are told apart). The error names the first bad example."""
    if not isinstance(images, torch.Tensor) or images.dim() < 2:
        raise InvalidDataError(f"{what} images must be a tensor (N, C, H, W), got {type(images).__name__}")
    if images.is_complex() or not (images.is_floating_point() or images.dtype == torch.uint8):
        raise InvalidDataError(
            f"{what} images have dtype {images.dtype}: give uint8 pixels (0-255) or floats in [0, 1], "
            "e.g. images.to(torch.uint8) for integer pixel values"
        )
    if images.is_floating_point():
        flat = images.reshape(images.shape[0], -1)
        finite = torch.isfinite(flat).all(dim=1)
        if not bool(finite.all()):
            index = int((~finite).nonzero()[0])
            raise InvalidDataError(
                f"{what} images[{index}] holds a non-finite value (NaN or inf) "
                f"({int((~finite).sum())} such examples): clean or drop them first"
            )
        _refuse_pixel_scale(flat, what)


def _refuse_pixel_scale(flat: torch.Tensor, what: str) -> None:
    """Refuse float images that are pixels in [0, 255]: the rule of NORMALISED_LIMIT.

    Pixels in [0, 1] lie in [0, 1]; normalised pixels, (x - mean) / std with x in [0, 1], may leave it, but stay
    within NORMALISED_LIMIT in magnitude unless a channel's std is below 1 / NORMALISED_LIMIT. So images with no
    value below 0 and some above 1, or with any value beyond NORMALISED_LIMIT, are read as pixels in [0, 255]
    (however many negative values they hold: one stray negative value does not make them normalised)."""
    if flat.numel() == 0:
        return
    low, high = float(flat.min()), float(flat.max())
    if low >= -PIXEL_TOLERANCE and high > 1 + PIXEL_TOLERANCE:
        index = int((flat.amax(dim=1) > 1 + PIXEL_TOLERANCE).nonzero()[0])
        raise InvalidDataError(
            f"{what} images hold values in [{low:g}, {high:g}] (images[{index}] exceeds 1): float images are "
            "read as pixels in [0, 1] (or as already normalised data, with negative values); divide them by "
            "255, or give uint8 pixels"
        )
    if max(-low, high) > NORMALISED_LIMIT:
        index = int((flat.abs().amax(dim=1) > NORMALISED_LIMIT).nonzero()[0])
        raise InvalidDataError(
            f"{what} images hold values in [{low:g}, {high:g}] (images[{index}] exceeds {NORMALISED_LIMIT:g} in "
            "magnitude): float images are read as pixels in [0, 1] or normalised pixels, which stay within "
            f"+-{NORMALISED_LIMIT:g}; these are pixels in [0, 255] (a value below 0 does not make them normalised): "
            "divide them by 255, or give uint8 pixels"
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


def check_model_input(model: nn.Module, example: torch.Tensor, shape: Sequence[int], what: str) -> None:
    """Refuse images of `shape` (example: one of them, normalised) that the model's first convolution cannot take.

    An equiconvert model's channel count decides; for another model a mismatch with its first Conv2d is confirmed
    by a forward pass of a copy (a model whose first-registered Conv2d is not its stem is not refused)."""
    channels = first_conv_channels(model)
    if channels is None or (example.dim() == 4 and example.shape[1] == channels):
        return
    if not isinstance(getattr(model, "in_channels", None), int) and _forward_fits(model, example):
        return
    raise ImageShapeError(image_shape_message(shape, channels, f"{what} images"))


def _forward_fits(model: nn.Module, example: torch.Tensor) -> bool:
    """Whether a copy of `model` (the model trained sees no data outside DP-SGD steps) takes two such examples."""
    probe = copy.deepcopy(model).eval()
    try:
        with torch.no_grad():
            probe(example[:1].expand(2, *example.shape[1:]))
    except RuntimeError:
        return False
    return True
