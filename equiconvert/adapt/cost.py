"""What a forward pass costs per image: multiply-adds and activations of its convolutions and linear layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..nn.conv import SteerableConv2d

# layer type -> the multiply-adds of one output element (its input fan-in): convolutions as F.conv2d runs them
FAN_IN = {
    nn.Conv2d: lambda m: m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1],
    SteerableConv2d: lambda m: m.in_channels // m.groups * m.kernel_size**2,
    nn.Linear: lambda m: m.in_features,
}


@dataclass(frozen=True)
class ForwardCost:
    """Per image: parameters, multiply-adds and output elements (activations kept for backward) of the layers in FAN_IN."""

    parameters: int
    multiply_adds: int
    activations: int


def forward_cost(model: nn.Module, inputs: torch.Tensor) -> ForwardCost:
    """Count the cost of `model` on `inputs` (a batch) with forward hooks, divided by the batch size."""
    totals = {"multiply_adds": 0, "activations": 0}

    def count(module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        per_image = output.numel() // output.shape[0]
        totals["activations"] += per_image
        totals["multiply_adds"] += per_image * FAN_IN[type(module)](module)

    hooks = [m.register_forward_hook(count) for m in model.modules() if type(m) in FAN_IN]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return ForwardCost(sum(p.numel() for p in model.parameters()), **totals)
