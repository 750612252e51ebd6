"""Refuse PyTorch Lightning set-ups in which make_private's epsilon would not hold.

Opacus' Lightning recipe calls make_private inside `configure_optimizers` and trains on the batches Lightning draws
from its own loader: those are not Poisson batches, so the epsilon the accountant reports assumes a sampling that
never happened. equiconvert.lightning.DPLightningCallback makes the run private instead and hands Lightning the
Poisson loader. This module imports no Lightning: a LightningModule is recognised only when Lightning is loaded.
"""

from __future__ import annotations

import sys

from torch import nn

from ..errors import UsageError

USE_THE_CALLBACK = (
    "train with equiconvert.lightning.DPLightningCallback instead (it makes the model private at fit start and "
    "gives Lightning the Poisson loader; docs/guides/lightning.md)"
)
_LIGHTNING_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


class LightningIntegrationError(UsageError, ValueError):
    """A Lightning set-up under which DP-SGD's accounting would not hold; the message says what to change."""


def is_lightning_module(module: nn.Module) -> bool:
    """Whether `module` is a LightningModule of a Lightning package that is already imported."""
    for package in _LIGHTNING_PACKAGES:
        loaded = sys.modules.get(package)
        if loaded is not None and isinstance(module, loaded.LightningModule):
            return True
    return False


def refuse_lightning_module(module: nn.Module) -> None:
    """make_private on a LightningModule is Opacus' recipe, whose batches come from Lightning's own loader."""
    if is_lightning_module(module):
        raise LightningIntegrationError(
            f"make_private was given a LightningModule ({type(module).__name__}): Lightning would train it on "
            "batches from its own loader, not Poisson ones, and the reported epsilon would be wrong; "
            + USE_THE_CALLBACK
        )


def refuse_undrawn_batch(drawn: int, steps: int) -> None:
    """A step driven through a closure (Lightning's loop) must be for a batch its Poisson loader drew."""
    if drawn <= steps:
        raise LightningIntegrationError(
            f"optimizer.step(closure) #{steps + 1}: make_private's Poisson data loader has drawn only {drawn} "
            "batch(es), so this step trains on batches from another loader (a training framework's own) and the "
            "epsilon would be wrong; iterate the data loader make_private returned, or with Lightning "
            + USE_THE_CALLBACK
        )
