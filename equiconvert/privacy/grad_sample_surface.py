"""Opacus' GradSampleModule surface on make_private's module: what Opacus scripts call on the returned model.

Opacus records per-example gradients with hooks; make_private's module records each layer's input and output
gradient in a training forward (private_module.py). Here that recording answers to Opacus' names:
`disable_hooks`/`enable_hooks` switch it off and on (a training forward without it forms ordinary `.grad`, and the
optimizer then refuses a private step), `remove_hooks`/`to_standard_module` switch it off for good, each trainable
parameter's `grad_sample` holds its per-example gradients after a backward (book-keeping; None under ghost
clipping, as in Opacus), and named submodules of the wrapped model are attributes, as Opacus' `__getattr__` gives
them. Gradient accumulation over several backwards is always refused (physical batches: BatchMemoryManager).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import CallOrderError
from .bookkeeping import LayerRecord
from .opacus_parity import ALLOW_GRAD_ACCUMULATION, DISABLED_HOOKS, REMOVED_HOOKS, OpacusAttributeError

# the states of the recording (Opacus' hooks): a removed recording cannot be enabled again
HOOKS_ENABLED, HOOKS_DISABLED, HOOKS_REMOVED = "enabled", "disabled", "removed"


@dataclass
class CompletingRecord(LayerRecord):
    """A LayerRecord that calls `on_complete(self)` once every layer's output gradient has arrived."""

    on_complete: Callable[[LayerRecord], None] | None = None

    def _keep_grad(self, name: str, grad: torch.Tensor) -> None:
        super()._keep_grad(name, grad)
        if self.on_complete is not None and len(self.grads) == len(self.layers):
            self.on_complete(self)


class GradSampleSurface:
    """Mixed into PrivateModule (before nn.Module): needs `_module`, `_hooks`, `_published` and `clear_record()`."""

    _module: nn.Module
    _hooks: str
    _published: dict[nn.Parameter, torch.Tensor] | None
    batch_first = True  # the only layout served (opacus_parity.ACCEPTED)

    clear_record: Callable[[], None]  # PrivateModule's

    def __getattr__(self, name: str) -> Any:
        """A named submodule of the wrapped model (`model.fc1`), as Opacus' GradSampleModule gives it."""
        try:
            return super().__getattr__(name)  # type: ignore[misc]  (nn.Module's)
        except AttributeError:
            submodules = dict(super().__getattr__("_module").named_modules())  # type: ignore[misc]
            if name and name in submodules:
                return submodules[name]
            raise OpacusAttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None

    @property
    def hooks_enabled(self) -> bool:
        """Whether a training forward records what per-example gradients need (Opacus' flag of the same name)."""
        return self._hooks == HOOKS_ENABLED

    def disable_hooks(self) -> None:
        """Training forwards run the plain model (ordinary `.grad`, no per-example gradients) until enable_hooks()."""
        if self._hooks == HOOKS_ENABLED:
            self._hooks = HOOKS_DISABLED

    def enable_hooks(self) -> None:
        """Record training forwards again after disable_hooks()."""
        if self._hooks == HOOKS_REMOVED:
            raise CallOrderError(f"module.enable_hooks(): {REMOVED_HOOKS}")
        self._hooks = HOOKS_ENABLED

    def remove_hooks(self) -> None:
        """Stop recording for good (Opacus' Lightning example calls it before making its model private again)."""
        self._hooks = HOOKS_REMOVED
        self.clear_record()

    def to_standard_module(self) -> nn.Module:
        """The wrapped model, with the recording removed and no `grad_sample` left on its parameters."""
        self.remove_hooks()
        self.del_grad_sample()
        return self._module

    def forbid_grad_accumulation(self) -> None:
        """Already so: a second training forward before optimizer.step() is refused."""

    def allow_grad_accumulation(self) -> None:
        raise OpacusAttributeError(f"module.allow_grad_accumulation() is not supported: {ALLOW_GRAD_ACCUMULATION}")

    @property
    def grad_accumulation_allowed(self) -> bool:
        return False

    def require_hooks(self) -> None:
        """Refuse a private step after training forwards that recorded nothing (hooks disabled or removed)."""
        if self._hooks == HOOKS_DISABLED:
            raise CallOrderError(f"optimizer.step(): {DISABLED_HOOKS}")
        if self._hooks == HOOKS_REMOVED:
            raise CallOrderError(f"optimizer.step(): {REMOVED_HOOKS}")

    def publish_grad_samples(self, grads: dict[nn.Parameter, torch.Tensor]) -> None:
        """Each parameter's per-example gradients as its `grad_sample` (Opacus' attribute), until consumed."""
        for param, value in grads.items():
            param.grad_sample = value
        self._published = grads

    def set_grad_sample_to_none(self) -> None:
        """Every trainable parameter's `grad_sample` set to None (filled again by the next training backward)."""
        self._published = None
        for p in self._module.parameters():
            if p.requires_grad:
                p.grad_sample = None

    def del_grad_sample(self) -> None:
        """Remove the `grad_sample` attribute from the wrapped model's parameters."""
        self._published = None
        for p in self._module.parameters():
            if hasattr(p, "grad_sample"):
                del p.grad_sample

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear `.grad`, `grad_sample` and the last backward's record (the optimizer's zero_grad does the same)."""
        super().zero_grad(set_to_none)  # type: ignore[misc]  (nn.Module's)
        self.clear_record()
