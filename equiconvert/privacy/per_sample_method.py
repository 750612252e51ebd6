"""Which per-example gradient back-end a DP-SGD run uses (backends.py), and computing with it.

An explicit per_sample_method takes its registered back-end at the run's precision. "auto" takes the first
back-end of AUTO_ORDER registered at that precision that passes its static check (at construction) and its
probe (at the first step): book-keeping where the model allows it, else vmap, which is exact for any model
but runs in fp32 only, so a bf16 run whose model book-keeping cannot run stops instead of falling back.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, MutableMapping
from typing import TypeVar

import torch
from torch import nn

from ..errors import ParameterError
from .backends import AUTO, AUTO_ORDER, BACKENDS, Backend, UnknownBackendError, backend_for
from .bookkeeping import BookkeepingUnsupportedError
from .filter_gradients import filter_gradient_method, times_kernels
from .inplace_buffers import TORCH_FUNC_MUTATION, in_place_buffer_error

Tensors = dict[str, torch.Tensor]
Result = TypeVar("Result")
# loss_fn(logits (N, classes), labels (N,)) -> per-example losses (N,)
PerExampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PerSampleGradients:
    """model's per-example gradients (averaged over each example's views) and losses, by its back-end."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: PerExampleLoss,
        method: str,
        precision: str,
        filter_gradients: str,
        physical_batch_size: int,
    ) -> None:
        """method, precision, filter_gradients and physical_batch_size: DPConfig's. The physical batch is the public
        size "fastest" times its filter-gradient kernels at (a chunk's own size can be secret)."""
        self.model, self.loss_fn = model, loss_fn
        self.requested, self.precision, self.filter_gradients = method, precision, filter_gradients
        self.physical_batch_size = physical_batch_size
        if method != AUTO:
            self._candidates = [backend_for(method, precision)]
        else:
            self._candidates = [BACKENDS[(m, precision)] for m in AUTO_ORDER if (m, precision) in BACKENDS]
        if not self._candidates:
            raise UnknownBackendError(method, precision)
        self._tried: list[str] = []
        self.backend = self._first_supported(None)
        self._verified = False  # the back-end's probe runs once, at the first per-sample computation
        self._kernels_timed = False  # as does the timing of the filter-gradient kernels (_time_kernels)

    @property
    def method(self) -> str:
        """The method of the back-end in use ("bookkeeping", "ghost", "vmap")."""
        return self.backend.method

    def _first_supported(self, error: Exception | None) -> Backend:
        """The next candidate whose static check passes; past the last, the failure (explicit method) or why
        "auto" found none at this precision."""
        while self._candidates:
            backend = self._candidates.pop(0)
            self._tried.append(backend.method)
            try:
                backend.check_supported(self.model)
            except BookkeepingUnsupportedError as failure:
                error = failure
                continue
            return backend
        assert error is not None  # there is a first candidate, and it failed
        if self.requested != AUTO:
            raise error
        raise self._none_at_precision(error) from error

    def _none_at_precision(self, error: Exception) -> BookkeepingUnsupportedError:
        """Where "auto" has no back-end left at this precision: name the precisions the exact one runs in."""
        exact = [p for m, p in BACKENDS if m == AUTO_ORDER[-1]]
        tried = " or ".join(repr(m) for m in self._tried)
        return BookkeepingUnsupportedError(
            f"precision {self.precision!r} needs per_sample_method {tried}, which this model cannot use "
            f"({error}); train it with precision {' or '.join(map(repr, exact))}"
        )

    def __call__(
        self, params: Tensors, buffers: Tensors, views: torch.Tensor, labels: torch.Tensor
    ) -> tuple[Tensors, torch.Tensor]:
        """Per-example gradients and losses (Backend.compute)."""
        return self._checked_call(
            params, buffers, views, lambda: self.backend.compute(self.model, params, buffers, views, labels, self._loss)
        )

    def accumulate_clipped(
        self,
        params: Tensors,
        buffers: Tensors,
        views: torch.Tensor,
        labels: torch.Tensor,
        max_grad_norm: float,
        into: MutableMapping[str, torch.Tensor],
        real: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | int]:
        """Add the examples' gradients clipped to max_grad_norm to `into` (Backend.accumulate_clipped); returns the
        losses and how many examples were non-finite. `real` (B,): False on blank padding rows; None: all real."""
        return self._checked_call(
            params,
            buffers,
            views,
            lambda: self.backend.accumulate_clipped(
                self.model, params, buffers, views, labels, self._loss, max_grad_norm, into, real
            ),
        )

    def _checked_call(
        self, params: Tensors, buffers: Tensors, views: torch.Tensor, compute: Callable[[], Result]
    ) -> Result:
        """`compute` with the run's filter-gradient kernel, after the back-end's probe and the kernels' timing at
        the first call; torch.func's refusal of an in-place buffer write names the module."""
        try:
            # the probe checks the kernel the run uses
            with filter_gradient_method(self.filter_gradients, timing_examples=self.physical_batch_size):
                while not self._verified:
                    self._verify(tuple(views.shape[1:]))
                if not self._kernels_timed:
                    self._time_kernels(params, buffers, views)
                return compute()
        except RuntimeError as error:
            if TORCH_FUNC_MUTATION not in str(error):
                raise
            raise in_place_buffer_error(self.model, views[:1, 0], error) from None

    def _time_kernels(self, params: Tensors, buffers: Tensors, views: torch.Tensor) -> None:
        """Where the filter-gradient kernels are timed ("fastest"), time them on one random example before the first
        batch: each layer's timing then runs on stand-ins of the physical batch while no batch's activations are
        held. Every RNG is left as it was."""
        self._kernels_timed = True
        if not times_kernels(views.device):
            return
        generator = torch.Generator(device=views.device).manual_seed(0)
        example = torch.randn((1, *views.shape[1:]), generator=generator, device=views.device, dtype=views.dtype)
        label = torch.zeros(1, dtype=torch.long, device=views.device)
        with torch.random.fork_rng(devices=[views.device] if views.device.type == "cuda" else []):
            self.backend.compute(self.model, params, buffers, example, label, self._loss)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """loss_fn in F.cross_entropy's calling convention: book-keeping asks for one loss per view
        (reduction "none"), vmap for one example's loss averaged over its views."""
        losses = self.loss_fn(logits, labels)
        if losses.shape != labels.shape:
            raise ParameterError(
                f"loss_fn must return one loss per example, shape {tuple(labels.shape)}; got {tuple(losses.shape)}"
            )
        return losses if reduction == "none" else losses.mean()

    def _verify(self, view_shape: tuple[int, ...]) -> None:
        """The back-end's probe; "auto" moves to its next candidate where it fails, an explicit method raises.

        The probe uses random inputs and leaves every RNG as it was, so a resumed run decides the same.
        """
        try:
            self.backend.verify(self.model, view_shape, self._loss)
        except Exception as error:  # noqa: BLE001  (any failure of the probe: the next candidate is exact)
            if self.requested != AUTO:
                raise
            failed = self.backend.method
            self.backend = self._first_supported(error)
            warnings.warn(f"per-sample gradients: {failed} cannot run this model ({error}); using {self.method}")
            return
        self._verified = True
