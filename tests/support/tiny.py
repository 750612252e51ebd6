"""Tiny models and data shared by several test modules: deterministic, seconds on a CPU."""

from __future__ import annotations

import torch
from torch import nn

N, SIZE, CLASSES = 32, 4, 3  # tiny_images(): N one-channel SIZE x SIZE images in CLASSES classes


def linear_classifier() -> nn.Module:
    """Flatten, then one linear layer: the smallest model the DP trainer takes, for tiny_images()."""
    return nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, CLASSES))


def tiny_images() -> tuple[torch.Tensor, torch.Tensor]:
    """The same N images in [0, 1) and labels on every call (their own generator: the global RNG is untouched)."""
    generator = torch.Generator().manual_seed(1)
    return torch.rand(N, 1, SIZE, SIZE, generator=generator), torch.randint(0, CLASSES, (N,), generator=generator)


def perturbed(model: nn.Module) -> nn.Module:
    """`model` in train mode, every parameter moved by 0.05 N(0, 1) (global seed 1): non-trivial affines and biases."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.train()
