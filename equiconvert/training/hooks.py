"""The callables and objects DPTrainer takes in place of its defaults, their signatures, and their check.

loss_fn's signature is privacy.per_sample_method.PerExampleLoss: the per-example gradients are computed from it.

A hook of the wrong kind fails deep inside the first step; check_hooks refuses it before anything is built,
naming the option.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ParameterTypeError
from .callbacks import Callback, MetricsLogger

# augment(images (B, C, H, W) on the device, K, generator) -> views (B, K, C, H, W), view 0 the image itself
Augment = Callable[[torch.Tensor, int, torch.Generator], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def check_hooks(loss_fn: Any, augment: Any, callbacks: Any, metrics_logger: Any) -> None:
    """The callables and objects given to DPTrainer, checked before anything is built (errors name the option)."""
    for name, value in (("loss_fn", loss_fn), ("augment", augment)):
        if value is not None and not callable(value):
            raise ParameterTypeError(f"{name} must be callable, got {type(value).__name__}")
    for callback in callbacks:
        if not isinstance(callback, Callback):
            raise ParameterTypeError(
                f"callbacks must be equiconvert.training.callbacks.Callback objects, got {type(callback).__name__}"
            )
    if metrics_logger is not None and not isinstance(metrics_logger, MetricsLogger):
        raise ParameterTypeError(
            f"metrics_logger must have log_metrics(metrics, step), got {type(metrics_logger).__name__}"
        )


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The default loss_fn: one cross-entropy per example."""
    return F.cross_entropy(logits, labels, reduction="none")
