"""What a DP training pipeline is made of, and the registry of the rebuilt ones."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

CIFAR10_MEAN_STD = ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))  # the statistics Opacus' examples use
IMAGENET_MEAN_STD = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
UNIT_RANGE = ((0.0,), (1.0,))  # ToTensor only: pixels in [0, 1]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Pipeline:
    """One published DP pipeline: everything its training script fixes, plus where it comes from.

    `build(width)` returns the original network with every hidden width multiplied by `width` (1.0: as published),
    so that a widened original can be matched to a conversion's parameter count.
    """

    name: str
    source: str  # the paper and the code it follows
    published: str  # the number its authors report, with its setting
    translated: str  # what differs from the original script here, and why
    dataset: str  # a name of equiconvert.data's registry
    build: Callable[[float], nn.Module]
    optimizer: OptimizerFactory
    batch_size: int  # expected (Poisson) batch size
    epochs: int
    epsilon: float
    delta: float
    max_grad_norm: float
    normalize: tuple[tuple[float, ...], tuple[float, ...]]
    input_size: int  # the size the images are fed at (padded where the original pads)
    physical_batch_size: int = 1024
    group: str = "D4"
    # make_equivariant config every conversion of this network needs (what its refusal tells a user to pass)
    conversion_config: dict[str, Any] = field(default_factory=dict)


PIPELINES: dict[str, Pipeline] = {}


def register(pipeline: Pipeline) -> Pipeline:
    if pipeline.name in PIPELINES:
        raise ValueError(f"pipeline {pipeline.name!r} registered twice")
    PIPELINES[pipeline.name] = pipeline
    return pipeline


def scaled(channels: int, width: float) -> int:
    """A hidden width multiplied by `width`, at least one channel."""
    return max(1, round(channels * width))


def group_norm_width(channels: int, width: float) -> int:
    """A widened width that GroupNorm(min(32, C), C) still divides: below 32 any, from 32 on a multiple of 32."""
    wide = scaled(channels, width)
    return wide if wide < 32 else 32 * max(1, round(wide / 32))


def sgd(lr: float, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> OptimizerFactory:
    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)

    return make
