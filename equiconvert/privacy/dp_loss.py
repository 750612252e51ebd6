"""The criterion make_private returns with grad_sample_mode="ghost", in the place Opacus returns its
DPLossFastGradientClipping.

Opacus' ghost clipping packs two backward passes into its loss wrapper; make_private's ghost clipping needs one
ordinary backward (its norms and clipped sum read the layers' recorded output gradients: ghost.py). This wrapper
reduces the loss as Opacus' does (each example's loss, a sequence's tokens averaged or summed into
one example where `shape` says so, then the mean or sum over the batch) and returns a plain tensor, so the loop
`loss = criterion(model(x), y); loss.backward(); optimizer.step()` runs unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .opacus_parity import OpacusArgumentError


class DPLoss:
    """`criterion` computed per example and reduced by `loss_reduction` ("mean" or "sum")."""

    def __init__(self, criterion: Callable[..., torch.Tensor], loss_reduction: str) -> None:
        if not hasattr(criterion, "reduction"):  # as Opacus: a criterion without one takes the module's
            criterion.reduction = loss_reduction  # type: ignore[attr-defined]
        if criterion.reduction != loss_reduction:  # type: ignore[attr-defined]
            raise OpacusArgumentError(
                f"criterion.reduction={criterion.reduction!r} but loss_reduction={loss_reduction!r}: the "  # type: ignore[attr-defined]
                "per-example gradients are scaled for loss_reduction; build the criterion with the same reduction"
            )
        self.criterion = criterion
        self.loss_reduction = loss_reduction

    def __call__(self, *args: Any, shape: tuple[int, ...] | None = None, **kwargs: Any) -> torch.Tensor:
        old = self.criterion.reduction  # type: ignore[attr-defined]
        self.criterion.reduction = "none"  # type: ignore[attr-defined]
        try:
            per_row = self.criterion(*args, **kwargs)
        finally:
            self.criterion.reduction = old  # type: ignore[attr-defined]
        if shape is not None and per_row.shape[0] == shape[0] * shape[1]:  # (B*T,) token losses: one per sequence
            per_row = self._per_sequence(per_row.view(shape[0], shape[1]), args, kwargs)
        return per_row.mean() if self.loss_reduction == "mean" else per_row.sum()

    def _per_sequence(self, tokens: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        if self.loss_reduction == "sum":
            return tokens.sum(1)
        ignore_index = getattr(self.criterion, "ignore_index", None)
        targets = kwargs.get("target", args[1] if len(args) >= 2 else None)
        if ignore_index is None or targets is None:
            return tokens.mean(1)
        valid = (targets.view(tokens.shape) != ignore_index).sum(1).clamp(min=1)  # ignored tokens leave the mean
        return tokens.sum(1) / valid
