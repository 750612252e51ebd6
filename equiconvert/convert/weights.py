"""Which trained weights a conversion keeps: measured, by comparing the converted model with the original.

A converted layer keeps its weights when every parameter it owns has the same
qualified name, shape and values as in the original model. Steerable convolutions
(basis coefficients), field norms (one scale per field) and layers whose input width
changed (a Linear head after group pooling) have no counterpart and start from their
initialisation: fine-tuning a converted pretrained model does not start from its weights, unless
equiconvert.carry_weights sets them (adapt/carry.py).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .report import ConversionReport


def _layers(model: nn.Module) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Module path -> its own parameters (name, tensor), for modules that own parameters."""
    return {
        path: list(module.named_parameters(recurse=False))
        for path, module in model.named_modules()
        if any(True for _ in module.parameters(recurse=False))
    }


def weight_transfer(original: nn.Module, converted: nn.Module) -> tuple[list[str], list[str]]:
    """(kept, reinitialised): the converted model's parametrised layers whose parameters equal the original's, and the rest."""
    before = dict(original.named_parameters())
    kept, fresh = [], []
    for path, params in _layers(converted).items():
        same = all(
            (old := before.get(f"{path}.{name}" if path else name)) is not None
            and old.shape == value.shape
            and torch.equal(old.detach().cpu(), value.detach().cpu())
            for name, value in params
        )
        (kept if same else fresh).append(path)
    return kept, fresh


def report_pretrained_weights(original: nn.Module, converted: nn.Module, report: ConversionReport) -> None:
    """Record which layers kept the original's weights, and warn (report and Python warning) about the rest."""
    kept, fresh = weight_transfer(original, converted)
    report.weights_kept, report.weights_reinitialised = kept, fresh
    if fresh:
        report.weights_warning = (
            f"the model's pretrained weights do not carry over to {len(fresh)} of its {len(kept) + len(fresh)} "
            "parametrised layers: steerable convolutions, field norms and layers whose input width changed are "
            f"freshly initialised; layers that kept their weights: {', '.join(kept) if kept else 'none'}"
        )
        warnings.warn(report.weights_warning, stacklevel=3)
