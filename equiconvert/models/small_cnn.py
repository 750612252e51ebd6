"""SmallCNN: a small DP-safe CNN for 28x28 grayscale images, the backbone of the adaptation recipes.

Four 3x3 convolutions, each followed by GroupNorm(4) and ReLU (the last three with stride 2), global average
pooling and a linear classifier: 61,226 parameters for 10 classes. It trains in seconds on a GPU, which makes it
the model on which the pretrained-adaptation benchmark and recipes compare canonicalisation, carried weights and
conversion from scratch.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..errors import ParameterError
from ._registry import register_model

__all__ = ["SmallCNN", "small_cnn"]


class SmallCNN(nn.Module):
    """Convolutions with GroupNorm (DP-safe), global average pooling and a linear classifier."""

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 1,
        widths: Sequence[int] = (16, 32, 64, 64),
        strides: Sequence[int] = (1, 2, 2, 2),
    ) -> None:
        super().__init__()
        if len(widths) != len(strides) or not widths:
            raise ParameterError(f"widths {tuple(widths)} and strides {tuple(strides)} must be as long, and not empty")
        if any(width % 4 for width in widths):
            raise ParameterError(f"widths {tuple(widths)}: each must be a multiple of 4 (GroupNorm's 4 groups)")
        layers: list[nn.Module] = []
        c_in = in_channels
        for c_out, stride in zip(widths, strides):
            layers += [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.GroupNorm(4, c_out), nn.ReLU()]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


@register_model
def small_cnn(
    num_classes: int = 10,
    in_channels: int = 1,
    widths: Sequence[int] = (16, 32, 64, 64),
    strides: Sequence[int] = (1, 2, 2, 2),
) -> nn.Module:
    """SmallCNN (module docstring): four convolutions with GroupNorm, for 28x28 grayscale images."""
    return SmallCNN(num_classes, in_channels, widths, strides)
