"""Accuracy and calibration metrics of a classifier (Hölzl et al. report calibration of DP models).

DP-SGD training tends to hurt calibration, so accuracy alone hides part of
what equivariance buys; the Brier score and ECE make that visible.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ParameterError
from .augment import shifted_views


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor, num_bins: int = 15) -> dict[str, float]:
    """accuracy, loss, brier and ece of (N, C) logits against (N,) integer labels.

    * loss: mean cross-entropy (nats).
    * brier: multi-class Brier score, (1/N) sum_n sum_c (p_nc - y_nc)^2 with
      one-hot y; it ranges over [0, 2] (uniform predictions give 1 - 1/C).
      Note: not divided by C (some libraries average over classes too).
    * ece: expected calibration error of the top-1 confidence with `num_bins`
      equal-width bins (lo, hi] on [0, 1], sum_b |B_b|/N * |acc(B_b) - conf(B_b)|
      (Guo et al. 2017).
    Computed in float64 so that small gaps are not rounding noise.
    """
    if logits.dim() != 2 or labels.dim() != 1 or logits.shape[0] != labels.shape[0]:
        raise ParameterError(
            f"logits must be (N, C) and labels (N,), got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if logits.shape[0] == 0:
        raise ParameterError("logits and labels are empty; metrics need at least one example")
    if num_bins < 1:
        raise ParameterError(f"num_bins must be >= 1, got {num_bins}")
    logits = logits.detach().to(torch.float64)
    labels = labels.detach().to(device=logits.device, dtype=torch.long)
    count, num_classes = logits.shape
    log_probs = F.log_softmax(logits, dim=1)
    probs = log_probs.exp()
    loss = F.nll_loss(log_probs, labels)
    brier = (probs - F.one_hot(labels, num_classes).to(probs.dtype)).pow(2).sum(dim=1).mean()
    confidence, prediction = probs.max(dim=1)
    correct = (prediction == labels).to(torch.float64)
    # Bin b holds confidences in (b/num_bins, (b+1)/num_bins]; confidence >= 1/C > 0 always.
    bins = (torch.ceil(confidence * num_bins).long() - 1).clamp(0, num_bins - 1)
    bin_correct = torch.zeros(num_bins, dtype=torch.float64, device=logits.device).index_add_(0, bins, correct)
    bin_confidence = torch.zeros(num_bins, dtype=torch.float64, device=logits.device).index_add_(0, bins, confidence)
    ece = (bin_correct - bin_confidence).abs().sum() / count  # sum_b |B_b|/N * |acc_b - conf_b|
    return {
        "accuracy": correct.mean().item(),
        "loss": loss.item(),
        "brier": brier.item(),
        "ece": ece.item(),
    }


@torch.no_grad()
def evaluate(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    device: torch.device | str,
    normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
    shifts: Sequence[tuple[int, int]] | None = None,
) -> dict[str, float]:
    """Metrics of `model` on a whole evaluation set, in eval mode, batch by batch on `device`.

    uint8 images are scaled to float32 in [0, 1] first; float images are used
    as given. `normalize` (e.g. per-channel standardisation) is then applied on
    the device. With `shifts` ((dy, dx) pairs, augment.shifted_views) each
    image's prediction is the mean of the softmax over its shifted copies
    (test-time augmentation); the metrics then score the log of that mean.
    The model's train/eval mode is restored afterwards.
    """
    outputs = predict(model, images, batch_size, device, normalize, shifts)
    return classification_metrics(outputs, labels.to(outputs.device))


@torch.no_grad()
def predict(
    model: nn.Module,
    images: torch.Tensor,
    batch_size: int,
    device: torch.device | str,
    normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
    shifts: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """The (N, classes) outputs `evaluate` scores: logits, or shift-averaged log-probabilities with `shifts`."""
    if batch_size < 1:
        raise ParameterError(f"batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    model.eval()
    try:
        outputs = []
        for start in range(0, images.shape[0], batch_size):
            batch = images[start : start + batch_size].to(device, non_blocking=True)
            if batch.dtype == torch.uint8:
                batch = batch.to(torch.float32) / 255.0
            if normalize is not None:
                batch = normalize(batch)
            outputs.append(model(batch) if shifts is None else _shift_averaged_log_probs(model, batch, shifts))
        return torch.cat(outputs)
    finally:
        model.train(was_training)


def _shift_averaged_log_probs(model: nn.Module, batch: torch.Tensor, shifts: Sequence[tuple[int, int]]) -> torch.Tensor:
    """log of the mean softmax of `model` over the shifted copies of each image in `batch`."""
    views = shifted_views(batch, shifts)  # (B, S, C, H, W)
    logits = model(views.flatten(0, 1)).unflatten(0, views.shape[:2])  # (B, S, classes)
    return torch.logsumexp(F.log_softmax(logits.double(), dim=-1), dim=1) - math.log(len(shifts))
