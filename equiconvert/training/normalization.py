"""Input normalisation of DPTrainer: (images - mean) / std per channel, uint8 pixels read as [0, 1] first.

The options normalize_mean/normalize_std are one value or one per channel; check_normalization refuses bad
ones with the config (before any data), Normalize applies them to every batch on the trainer's device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ParameterError


def _channel_values(value: float | Sequence[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (tuple, list)) else (float(value),)


def check_normalization(mean: Any, std: Any) -> None:
    """normalize_mean/normalize_std: finite numbers, one or one per channel, std > 0, the same channel count."""
    values = {}
    for name, value in (("normalize_mean", mean), ("normalize_std", std)):
        try:
            values[name] = _channel_values(value)
        except (TypeError, ValueError):
            raise ParameterError(
                f"{name} must be a number or a tuple of numbers (one per channel), got {value!r}"
            ) from None
        if not values[name] or not all(math.isfinite(v) for v in values[name]):
            raise ParameterError(f"{name} must be finite numbers, one or one per channel, got {value!r}")
    if not all(v > 0 for v in values["normalize_std"]):
        raise ParameterError(f"normalize_std must be > 0 in every channel, got {std!r}")
    lengths = {len(v) for v in values.values()} - {1}
    if len(lengths) > 1:
        raise ParameterError(f"normalize_mean {mean!r} and normalize_std {std!r} give different channel counts")


class Normalize:
    """images -> (images - mean) / std on `device`, in `dtype` (the model's: float64 or float16 images would not
    meet float32 weights); the per-channel constants are made there once (a copy to the device at every step
    would wait for it)."""

    def __init__(
        self,
        mean: float | Sequence[float],
        std: float | Sequence[float],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device, self.dtype = device, dtype
        self.mean, self.std = _constants(_channel_values(mean), _channel_values(std), device)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = images.to(self.dtype).div_(255.0)
        else:
            images = images.to(self.dtype)
        mean, std = self.mean, self.std
        if isinstance(mean, torch.Tensor) and images.dim() >= 3 and images.shape[-3] != mean.shape[0]:
            raise ParameterError(
                f"normalize_mean/normalize_std give {mean.shape[0]} channels; the images have "
                f"{images.shape[-3]}: give one value per image channel, or one value"
            )
        return (images - mean) / std


def _constants(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """(mean, std): numbers when both are one value, else (C, 1, 1) tensors on `device`."""
    channels = max(len(mean), len(std))
    if channels == 1:
        return mean[0], std[0]
    return tuple(
        torch.tensor(values, device=device).expand(channels).reshape(channels, 1, 1).clone() for values in (mean, std)
    )
