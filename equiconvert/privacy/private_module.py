"""The module make_private returns: the user's model, recording what book-keeping needs.

In training mode with gradients enabled, a forward runs the model with its trainable
parameters detached from autograd (so `loss.backward()` computes activation gradients
only, the cost of a non-private backward less its weight gradients) and keeps, for
every layer that owns trainable parameters, its input and the gradient of its output.
`per_sample_gradients()` then forms each example's gradient layer by layer with the
book-keeping back-end of backends.py (closed forms for convolutions, steerable
convolutions, linear layers and embeddings, the vmapped VJP of the layer alone for
norms and any other layer that owns its parameters). `accumulate_clipped()` gives the
optimizer the clipped sum by the back-end of the Opacus grad_sample_mode: every
per-example gradient at once (book-keeping), or ghost clipping (ghost.py: each layer's
per-example norms a slice at a time, then the clipped sum as one weight gradient per
layer), which runs in fp32 only.

With aug_mult K > 1 the input is (B, K, ...): the K views of each example run as
B*K rows and the loss takes one target per view (`y.repeat_interleave(K)`); each
example's gradient is the mean over its views of the gradient of its per-view loss.

Opacus' GradSampleModule surface: with book-keeping, each trainable parameter's `grad_sample`
holds its per-example gradients (B, *shape) from the end of `loss.backward()` until the
optimizer consumes them (ghost clipping forms none: None, as in Opacus); `disable_hooks`,
`enable_hooks`, `remove_hooks` and `to_standard_module` switch the recording off (a training
forward then forms ordinary gradients, and a private step is refused); named submodules of the
wrapped model are attributes of this module.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CallOrderError, ParameterError, PrivacyError
from .backends import BACKENDS, PRECISIONS, backend_for
from .bookkeeping import BookkeepingUnsupportedError, LayerRecord, parametrised_layers, parameters_frozen
from .buffer_guard import BufferGuard
from .dp_safety import probe_dp_safety
from .dp_step import clip_and_accumulate
from .grad_sample_surface import HOOKS_ENABLED, CompletingRecord, GradSampleSurface
from .opacus_parity import DEFAULT_GRAD_SAMPLE_MODE, GRAD_SAMPLE_MODES
from .shape_probe import BatchShapeProbe
from .validate import PrivacyValidationError

LOSS_REDUCTIONS = ("mean", "sum")
# the precision (backends.py) of a forward and backward the user runs: the model's own dtype
PRECISION = "fp32"
LOW_PRECISIONS = tuple(name for name, dtype in PRECISIONS.items() if dtype is not None)
HALF_DTYPES = (torch.bfloat16, torch.float16)


class PerExampleGradientError(PrivacyError, RuntimeError):
    """The last forward cannot give true per-example gradients: a layer input changed in place, a parameter unused."""


class PrivateModule(GradSampleSurface, nn.Module):
    """Wraps `module` (as `_module`, like Opacus' GradSampleModule); see the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        aug_mult: int = 1,
        loss_reduction: str = "mean",
        verify: bool = True,
        probe_batch: int | None = None,
        grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE,
    ) -> None:
        """probe_batch: the examples of a batch the data loader draws (the DP-safety probe runs at that size
        times aug_mult rows, or at the first input's rows where more). grad_sample_mode: Opacus' name of the
        back-end (opacus_parity.GRAD_SAMPLE_MODES)."""
        super().__init__()
        if aug_mult < 1:
            raise ParameterError(f"aug_mult must be >= 1, got {aug_mult}")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ParameterError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        if grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ParameterError(
                f"grad_sample_mode must be one of {tuple(GRAD_SAMPLE_MODES)}, got {grad_sample_mode!r}"
            )
        self.grad_sample_mode = grad_sample_mode
        self._backend = backend_for(GRAD_SAMPLE_MODES[grad_sample_mode].method, PRECISION)
        if self._backend.layer_gradients is None:
            raise ParameterError(
                f"make_private needs a back-end with per-layer rules; {self._backend.method!r} has none"
            )
        self._layer_gradients = self._backend.layer_gradients
        if half := sorted({str(p.dtype) for p in module.parameters() if p.requires_grad and p.dtype in HALF_DTYPES}):
            self._refuse_low_precision(f"the model's trainable parameters are {', '.join(half)}")
        self._backend.check_supported(module)  # refuses shared parameters and parametrised containers, by name
        self._module = module
        self.aug_mult = aug_mult
        self.loss_reduction = loss_reduction
        self._verify = verify
        self._probe_rows = (probe_batch or 0) * aug_mult
        self._guard: BufferGuard | None = None  # set by the DP-safety probe, at the first forward
        self._shapes: BatchShapeProbe | None = None  # the cross-example probe at each new batch shape
        self._record: LayerRecord | None = None
        self._examples = 0  # of the last recorded forward
        self._hooks = HOOKS_ENABLED  # Opacus' hooks: the recording (grad_sample_surface.py)
        self._published: dict[nn.Parameter, torch.Tensor] | None = None  # the last backward's grad_sample
        self.set_grad_sample_to_none()

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        x = self._flatten_views(x)
        if self._guard is None:
            self._probe_once(x)
        if not self.training:
            return self._module(x, *args, **kwargs)
        if self._shapes is not None:
            self._shapes.check(x)
        with self._guard.watch(x):  # a training forward sees private data: buffers may not keep anything of it
            return self._training_forward(x, *args, **kwargs)

    @property
    def method(self) -> str:
        """The per-example gradient back-end in use (backends.py): "bookkeeping" or "ghost"."""
        return self._backend.method

    def _refuse_low_precision(self, where: str) -> None:
        """A back-end registered for fp32 only (ghost clipping) refuses a model or forward below fp32, before it runs."""
        if any((self._backend.method, precision) in BACKENDS for precision in LOW_PRECISIONS):
            return
        served = [m for m, mode in GRAD_SAMPLE_MODES.items() if (mode.method, LOW_PRECISIONS[0]) in BACKENDS]
        raise ParameterError(
            f"grad_sample_mode={self.grad_sample_mode!r} runs in fp32 only, but {where}: train in fp32 (no "
            f"autocast), or use grad_sample_mode={served[0]!r} (book-keeping, which takes bf16 autocast)"
        )

    def _training_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or not self.hooks_enabled:
            return self._module(x, *args, **kwargs)
        if torch.is_autocast_enabled(x.device.type):
            self._refuse_low_precision(
                f"the forward runs under torch.autocast({torch.get_autocast_dtype(x.device.type)})"
            )
        if self._record is not None and self._record.grads:
            raise CallOrderError(
                "a second training forward before optimizer.step(): call optimizer.step() after each "
                "loss.backward() (for gradient accumulation use BatchMemoryManager)"
            )
        if self._verify:
            self._verify_once(x)
        self.set_grad_sample_to_none()
        record = CompletingRecord(
            parametrised_layers(self._module),
            twice="make_private needs every layer with trainable parameters to run once",
            on_complete=self._publish_grad_samples,
        )
        if not record.layers:
            raise ParameterError("the model has no trainable parameters")
        with record.attached(), parameters_frozen(self._module):
            output = self._module(x, *args, **kwargs)
        self._record, self._examples = record, x.shape[0] // self.aug_mult
        return output

    def _flatten_views(self, x: torch.Tensor) -> torch.Tensor:
        if self.aug_mult == 1:
            return x
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[1] != self.aug_mult:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ParameterError(
                f"with aug_mult={self.aug_mult} the input must be (B, {self.aug_mult}, ...) views of each "
                f"example, got {shape}"
            )
        return x.flatten(0, 1)

    def _probe_once(self, x: torch.Tensor) -> None:
        """dp_safety.probe_dp_safety on a copy, with random inputs shaped like `x` and at least as many rows as a
        batch of the data loader, before the module itself runs: refuse buffers written from the input or on every
        forward, and layers that mix examples. Then every training forward is guarded (buffer_guard.py), and each
        new batch shape probed for mixing (shape_probe.py) where this probe could run."""
        set_once: frozenset[str] = frozenset()
        rows = max(x.shape[0], self._probe_rows)
        if not x.is_floating_point():
            warnings.warn(
                "make_private: the model takes non-float inputs, so the probe of its buffers and of how it keeps "
                "examples apart (dp_safety.probe_dp_safety, random inputs) was not run; a training forward that "
                "changes any buffer is refused",
                stacklevel=3,
            )
        else:
            try:
                set_once = probe_dp_safety(self._module, x, rows)
                self._shapes = BatchShapeProbe(self._module, (rows, *x.shape[1:]))
            except PrivacyValidationError:
                raise
            except Exception as error:  # noqa: BLE001  (a forward needing several tensors: warn, do not refuse)
                warnings.warn(
                    f"make_private: the probe of the model's buffers and of how it keeps examples apart could not "
                    f"run ({error}); a training forward that changes any buffer is refused",
                    stacklevel=3,
                )
        self._guard = BufferGuard(self._module, set_once)

    def _verify_once(self, x: torch.Tensor) -> None:
        """bookkeeping.verify_bookkeeping on the first input shape: refuse models book-keeping gets wrong."""
        self._verify = False
        if not x.is_floating_point():
            warnings.warn(
                "make_private: the model takes non-float inputs, so the check that it keeps examples apart "
                "(bookkeeping.verify_bookkeeping, random images) was not run",
                stacklevel=3,
            )
            return
        try:
            self._backend.verify(self._module, (min(self.aug_mult, 2), *x.shape[1:]), F.cross_entropy)
        except BookkeepingUnsupportedError:
            raise
        except Exception as error:  # noqa: BLE001  (a model whose output is not class scores: say so, do not refuse)
            warnings.warn(
                f"make_private: the check that the model keeps examples apart could not run ({error})", stacklevel=3
            )

    def _checked_record(self) -> LayerRecord:
        """The last forward/backward's record, refused where it cannot give true per-example gradients."""
        record = self._record
        if record is None:
            raise CallOrderError("no recorded training forward: run the model in train mode and loss.backward() first")
        self._guard.check("in a training backward")  # e.g. a backward hook writing a frozen parameter
        missing = [name for name in record.layers if name not in record.grads]
        if missing:
            raise CallOrderError(
                f"layers {missing} got no gradient: call loss.backward() before optimizer.step(); a "
                "layer the loss does not use must be frozen (requires_grad_(False))"
            )
        if changed := record.inputs_changed():
            raise PerExampleGradientError(
                f"the inputs of layers {changed} were modified in place after those layers ran; their "
                "per-example gradients would be wrong: make that operation out of place"
            )
        return record

    @property
    def _scale(self) -> float:
        """From a layer's gradient of the reduced loss to each example's gradient of its mean loss over its views."""
        return float(self._examples) if self.loss_reduction == "mean" else 1.0 / self.aug_mult

    def accumulate_clipped(self, max_grad_norm: float, into: dict[nn.Parameter, torch.Tensor]) -> torch.Tensor | int:
        """Add the last forward/backward's examples' gradients, each clipped to max_grad_norm (a non-finite one as
        zero), to `into` by parameter, by this module's back-end; returns how many examples were non-finite."""
        if self._backend.recorded_clipped_sum is None:
            record = self._checked_record()  # its checks run whether or not the backward published the gradients
            grads = self._published if self._published is not None else self._gradients_of(record)
            self.set_grad_sample_to_none()  # consumed: each example's gradient is not kept past its clipping
            return clip_and_accumulate(grads, max_grad_norm, into)
        record = self._checked_record()
        return self._backend.recorded_clipped_sum(record, self.aug_mult, self._scale, max_grad_norm, into)

    def per_sample_gradients(self) -> dict[nn.Parameter, torch.Tensor]:
        """Each example's gradient (mean over its views) of every trainable parameter, from the last forward/backward."""
        return self._gradients_of(self._checked_record())

    def _publish_grad_samples(self, record: LayerRecord) -> None:
        """At the end of a backward (book-keeping): each parameter's `grad_sample`. A record the step refuses (an
        input changed in place, an unused parameter) publishes nothing; the step's checks then name the layer."""
        if self._backend.recorded_clipped_sum is not None or not self._examples or record.inputs_changed():
            return  # ghost clipping forms no per-example gradients; an empty batch has none
        try:
            with torch.enable_grad():
                self.publish_grad_samples(self._gradients_of(record))
        except PerExampleGradientError:
            return

    def _gradients_of(self, record: LayerRecord) -> dict[nn.Parameter, torch.Tensor]:
        scale = self._scale
        grads: dict[nn.Parameter, torch.Tensor] = {}
        for name, layer in record.layers.items():
            per_layer = self._layer_gradients(layer, record.inputs[name], record.grads[name], self.aug_mult)
            for param_name, value in per_layer.items():
                param = getattr(layer, param_name)
                if param.requires_grad:
                    grads[param] = value * scale
        unreached = [n for n, p in self._module.named_parameters() if p.requires_grad and p not in grads]
        if unreached:
            raise PerExampleGradientError(
                f"parameters {unreached} did not take part in the forward pass; freeze them "
                "(requires_grad_(False)) or use them"
            )
        return grads

    @property
    def pending_backward(self) -> bool:
        """Whether a recorded training backward waits for the optimizer's step."""
        return self._record is not None and bool(self._record.grads)

    @property
    def recorded_examples(self) -> int:
        """Examples of the last recorded forward (0 before any)."""
        return 0 if self._record is None else self._examples

    def clear_record(self) -> None:
        self._record = None
        self.set_grad_sample_to_none()
