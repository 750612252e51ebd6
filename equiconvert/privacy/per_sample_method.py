"""Which per-example gradient computation a DP-SGD run uses, and computing with it.

Book-keeping is the fastest but not every model allows it: "auto" takes it when the model passes the static
check (at construction) and the probe (at the first step), else vmap, which is exact for any model. A bf16
run needs book-keeping, so there a failed check stops the run instead of falling back.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .bookkeeping import (
    BookkeepingUnsupportedError,
    check_bookkeeping_supported,
    per_sample_gradients_bookkeeping,
    verify_bookkeeping,
)
from .dp_config import PRECISIONS, DPConfig
from .filter_gradients import filter_gradient_method
from .hooks import PerExampleLoss
from .inplace_buffers import TORCH_FUNC_MUTATION, in_place_buffer_error
from .per_sample import per_sample_gradients

Tensors = dict[str, torch.Tensor]


class PerSampleGradients:
    """model's per-example gradients (averaged over each example's views) and losses, by `method`."""

    def __init__(self, model: nn.Module, config: DPConfig, loss_fn: PerExampleLoss) -> None:
        self.model, self.config, self.loss_fn = model, config, loss_fn
        self.method = self._resolve()
        self._verified = False  # verify_bookkeeping runs once, at the first per-sample computation

    def _resolve(self) -> str:
        """The method this run uses; "auto" takes book-keeping when the model's static check allows it."""
        requested = self.config.per_sample_method
        if requested == "vmap":
            return "vmap"
        try:
            check_bookkeeping_supported(self.model)
        except BookkeepingUnsupportedError as error:
            if requested == "bookkeeping":
                raise
            if self.config.precision != "fp32":
                raise self._precision_needs_bookkeeping(error) from error
            return "vmap"
        return "bookkeeping"

    def _precision_needs_bookkeeping(self, error: Exception) -> BookkeepingUnsupportedError:
        """Where "auto" would fall back to vmap: vmap runs in fp32 only, so a bf16 run stops instead."""
        return BookkeepingUnsupportedError(
            f"precision {self.config.precision!r} needs book-keeping, which this model "
            f"cannot use ({error}); train it with precision 'fp32'"
        )

    def __call__(
        self, params: Tensors, buffers: Tensors, views: torch.Tensor, labels: torch.Tensor
    ) -> tuple[Tensors, torch.Tensor]:
        """Per-example gradients and losses; torch.func's refusal of an in-place buffer write names the module."""
        try:
            return self._compute(params, buffers, views, labels)
        except RuntimeError as error:
            if TORCH_FUNC_MUTATION not in str(error):
                raise
            raise in_place_buffer_error(self.model, views[:1, 0], error) from None

    def _compute(
        self, params: Tensors, buffers: Tensors, views: torch.Tensor, labels: torch.Tensor
    ) -> tuple[Tensors, torch.Tensor]:
        with filter_gradient_method(self.config.filter_gradients):  # the probe checks the kernel the run uses
            if self.method == "bookkeeping" and not self._verified:
                self._verify_bookkeeping(tuple(views.shape[1:]))
            if self.method == "bookkeeping":
                return per_sample_gradients_bookkeeping(
                    self.model, views, labels, self._loss, autocast_dtype=PRECISIONS[self.config.precision]
                )
        return per_sample_gradients(self.model, params, buffers, views, labels, self._loss)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """loss_fn in F.cross_entropy's calling convention: book-keeping asks for one loss per view
        (reduction "none"), vmap for one example's loss averaged over its views."""
        losses = self.loss_fn(logits, labels)
        if losses.shape != labels.shape:
            raise ValueError(
                f"loss_fn must return one loss per example, shape {tuple(labels.shape)}; got {tuple(losses.shape)}"
            )
        return losses if reduction == "none" else losses.mean()

    def _verify_bookkeeping(self, view_shape: tuple[int, ...]) -> None:
        """The probe of verify_bookkeeping; "auto" falls back to vmap where it fails, "bookkeeping" raises.

        The probe uses random inputs and leaves every RNG as it was, so a resumed run decides the same.
        """
        try:
            verify_bookkeeping(self.model, view_shape, self._loss)
        except Exception as error:  # noqa: BLE001  (any failure of the probe: vmap is always exact)
            if self.config.per_sample_method == "bookkeeping":
                raise
            if self.config.precision != "fp32":
                raise self._precision_needs_bookkeeping(error) from error
            warnings.warn(f"per-sample gradients: book-keeping cannot run this model ({error}); using vmap")
            self.method = "vmap"
        self._verified = True
