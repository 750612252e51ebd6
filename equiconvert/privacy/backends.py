"""The per-example gradient back-ends, by (method, precision): the one table DPTrainer and make_private pick from.

A back-end computes each example's gradient of its mean loss over its K views, and the sum of those gradients
clipped by dp_step.py's rule (`accumulate_clipped`: by default from all of them at once; a back-end with its own
`clipped_sum`, ghost clipping, never holds them all); noise is dp_step.py's alone. A back-end is registered with `@register_backend(method, *precisions)` on a factory
precision -> Backend, and looked up with `backend_for(method, precision)`; an unknown pair
raises UnknownBackendError listing the registered ones. DPConfig.per_sample_method takes these methods
and "auto" (per_sample_method.py: book-keeping where the model allows it, else a registered fallback).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ParameterError, UsageError
from .bookkeeping import (
    LayerRecord,
    check_bookkeeping_supported,
    layer_per_example_gradients,
    per_sample_gradients_bookkeeping,
    verify_bookkeeping,
)
from .dp_step import clip_and_accumulate
from .ghost import accumulate_clipped_ghost, recorded_clipped_sum
from .per_sample import Gradients, LossFn, per_sample_gradients

# forward/backward dtype under autocast (None: the model's own); per-sample gradients, clipping and noise stay fp32
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}
AUTO = "auto"  # per_sample_method: the first method of AUTO_ORDER the model allows, at the run's precision
AUTO_ORDER = ("bookkeeping", "vmap")  # fastest first; the last is exact for any model
Tensors = dict[str, torch.Tensor]


class UnknownBackendError(UsageError, ValueError):
    """No back-end is registered for a (method, precision) pair; the message lists those that are."""

    def __init__(self, method: str, precision: str) -> None:
        self.method, self.precision = method, precision
        choices = ", ".join(f"({m!r}, {p!r})" for m, p in sorted(BACKENDS))
        super().__init__(
            f"no per-example gradient back-end for per_sample_method {method!r} with precision {precision!r}; "
            f"registered (per_sample_method, precision): {choices}"
        )


PerExampleFn = Callable[
    [nn.Module, Tensors, Tensors, torch.Tensor, torch.Tensor, LossFn], tuple[Gradients, torch.Tensor]
]
# (model, views (B, K, ...), labels (B,), loss_fn, max_grad_norm, into, real rows (B,) or None for all) ->
# (losses (B,), non-finite examples)
ClippedSumFn = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, LossFn, float, MutableMapping[str, torch.Tensor], torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor | int],
]
LayerFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], dict[str, torch.Tensor]]
# (record of the caller's forward and backward, views per example, scale to each example's mean loss, max_grad_norm,
# into) -> non-finite examples
RecordedSumFn = Callable[[LayerRecord, int, float, float, MutableMapping[nn.Parameter, torch.Tensor]], torch.Tensor]


def _any_model(*_: object) -> None:
    """The check of a back-end that computes any model: nothing to refuse."""


@dataclass(frozen=True)
class Backend:
    """A per-example gradient back-end: a static check, a probe at the first step, and the computation."""

    method: str
    precision: str
    # (model, params, buffers, views (B, K, ...), labels (B,), loss_fn) -> ({parameter name: (B, *shape)}, losses (B,))
    compute: PerExampleFn
    # raise where this back-end cannot compute the model's per-example gradients (before any data)
    check_supported: Callable[[nn.Module], None] = _any_model
    # raise where its gradients would be wrong on the model (random inputs of one example's view shape, first step)
    verify: Callable[[nn.Module, tuple[int, ...], LossFn], None] = _any_model
    # one layer's per-example gradients from its recorded input and output gradient (bookkeeping.LayerRecord), for
    # a forward and backward the user runs (make_private); None: the back-end cannot serve one
    layer_gradients: LayerFn | None = None
    # the clipped sum without forming every per-example gradient at once; None: clip `compute`'s gradients
    clipped_sum: ClippedSumFn | None = None
    # the same from the record of a forward and backward the user ran (make_private); None: clip the gradients of
    # `layer_gradients`
    recorded_clipped_sum: RecordedSumFn | None = None

    def accumulate_clipped(
        self,
        model: nn.Module,
        params: Tensors,
        buffers: Tensors,
        views: torch.Tensor,
        labels: torch.Tensor,
        loss_fn: LossFn,
        max_grad_norm: float,
        into: MutableMapping[str, torch.Tensor],
        real: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | int]:
        """Add the examples' gradients, each clipped to max_grad_norm (non-finite ones as zero), to `into` by
        parameter name; returns the losses (B,) and how many examples were non-finite. `real` (B,): False on blank
        padding rows, which add zero and are not counted (privacy/nonfinite.py); None: every row is an example."""
        if self.clipped_sum is not None:
            return self.clipped_sum(model, views, labels, loss_fn, max_grad_norm, into, real)
        grads, losses = self.compute(model, params, buffers, views, labels, loss_fn)
        return losses, clip_and_accumulate(grads, max_grad_norm, into, real)


BACKENDS: dict[tuple[str, str], Backend] = {}
BackendFactory = Callable[[str], Backend]


def register_backend(method: str, *precisions: str) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator of a factory precision -> Backend: registers its back-end for each precision (a name of PRECISIONS)."""

    def register(factory: BackendFactory) -> BackendFactory:
        for precision in precisions:
            if precision not in PRECISIONS:
                raise ParameterError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
            if (method, precision) in BACKENDS:
                raise ParameterError(f"a back-end for ({method!r}, {precision!r}) is already registered")
            backend = factory(precision)
            if (backend.method, backend.precision) != (method, precision):
                raise ParameterError(f"the factory registered for ({method!r}, {precision!r}) built {backend}")
            BACKENDS[(method, precision)] = backend
        return factory

    return register


def backend_for(method: str, precision: str) -> Backend:
    """The registered back-end of (method, precision); UnknownBackendError lists the registered pairs."""
    try:
        return BACKENDS[(method, precision)]
    except KeyError:
        raise UnknownBackendError(method, precision) from None


def backend_methods() -> tuple[str, ...]:
    """The registered methods, in registration order."""
    return tuple(dict.fromkeys(method for method, _ in BACKENDS))


@register_backend("bookkeeping", *PRECISIONS)
def _bookkeeping(precision: str) -> Backend:
    """Book-keeping (bookkeeping.py): one forward and backward on all views under autocast, per-layer closed forms."""
    dtype = PRECISIONS[precision]
    return Backend(
        "bookkeeping",
        precision,
        compute=lambda model, params, buffers, views, labels, loss_fn: per_sample_gradients_bookkeeping(
            model, views, labels, loss_fn, autocast_dtype=dtype
        ),
        check_supported=check_bookkeeping_supported,
        verify=verify_bookkeeping,
        layer_gradients=layer_per_example_gradients,
    )


@register_backend("ghost", "fp32")
def _ghost(precision: str) -> Backend:
    """Ghost clipping (ghost.py): book-keeping's rules for each layer's per-example norms, one layer at a time, then
    the clipped sum, both read from one recorded backward; peak memory near a non-private step's. Its per-example
    gradients, for a caller that asks for them, are book-keeping's. fp32 only: its bf16 path is not yet checked
    against book-keeping's. Under make_private the user's own backward is the recorded one."""
    dtype = PRECISIONS[precision]
    bookkeeping = _bookkeeping(precision)
    return Backend(
        "ghost",
        precision,
        compute=bookkeeping.compute,
        check_supported=check_bookkeeping_supported,
        verify=verify_bookkeeping,
        layer_gradients=layer_per_example_gradients,
        recorded_clipped_sum=recorded_clipped_sum,
        clipped_sum=lambda model, views, labels, loss_fn, max_grad_norm, into, real: accumulate_clipped_ghost(
            model, views, labels, loss_fn, max_grad_norm, into, real, autocast_dtype=dtype
        ),
    )


@register_backend("vmap", "fp32")
def _vmap(precision: str) -> Backend:
    """torch.func's vmap(grad) (per_sample.py): exact for any model, in the model's own dtype."""
    return Backend("vmap", precision, compute=per_sample_gradients)
