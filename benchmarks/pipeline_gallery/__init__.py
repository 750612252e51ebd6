"""Public DP training pipelines rebuilt as their authors published them, for `benchmarks/pipelines.py`.

Each module registers one or more `Pipeline`s (model, data handling, optimiser, clip, batch, epochs, privacy
budget) with the source it follows and the number its authors report. Importing this package registers them all.
"""

from __future__ import annotations

from . import (
    de_wrn,
    equiconvert_fmnist,
    opacus_cifar10,
    opacus_resnet18,
    resnet9_scalenorm,
    timm_groupnorm,
    tramer_boneh,
)
from .base import PIPELINES, Pipeline

__all__ = ["PIPELINES", "Pipeline"]
_REGISTERED = (
    de_wrn,
    equiconvert_fmnist,
    opacus_cifar10,
    opacus_resnet18,
    resnet9_scalenorm,
    timm_groupnorm,
    tramer_boneh,
)
