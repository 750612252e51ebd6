"""The optimizer handed to make_private must update the module's parameters, or its updates would not be private."""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from ..errors import UsageError


class ForeignParametersError(UsageError, ValueError):
    """An optimizer updates parameters that are not the module's (commonly: built before the model was converted)."""


def check_optimizer_params(module: nn.Module, optimizer: Optimizer, *, caller: str, frozen_too: bool = False) -> None:
    """Refuse an optimizer holding parameters outside `module` (trainable ones; every one with `frozen_too`)."""
    owned = {id(p) for p in module.parameters()}
    foreign = [
        tuple(p.shape)
        for group in optimizer.param_groups
        for p in group["params"]
        if (frozen_too or p.requires_grad) and id(p) not in owned
    ]
    if foreign:
        raise ForeignParametersError(
            f"{caller}: the optimizer updates {len(foreign)} parameter(s) that are not the module's (shapes "
            f"{foreign[:5]}), so their updates would not be private; equiconvert.make_equivariant returns a new "
            "model: build the optimizer from the model you pass as module (after the conversion), "
            "e.g. torch.optim.SGD(model.parameters(), lr=...)"
        )
