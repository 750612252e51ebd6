"""Name the module whose forward writes a buffer in place: torch.func's own error names only the operation.

Per-example gradients run the model under torch.func, which refuses any in-place write to a tensor the function
captured ("attempted to call in-place operation (aten::add_.Tensor) that would mutate a captured Tensor"). Such a
write to a buffer is also a leak: a buffer updated at every forward (a counter, a running statistic) ends up in
the released weights as a function of the secret batches.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .validate import PrivacyValidationError

TORCH_FUNC_MUTATION = "that would mutate a captured Tensor"  # in torch.func's message for an in-place write


class InPlaceBufferError(PrivacyValidationError):
    """A module's forward writes one of its buffers in place."""


def buffers_written_in_place(model: nn.Module, example: torch.Tensor) -> list[str]:
    """Dotted names of the buffers that a forward of a copy of `model` (train mode) on zeros like `example` writes in
    place (each write bumps a tensor's version counter, whatever value it writes)."""
    probe = copy.deepcopy(model).train()
    before = {name: buffer._version for name, buffer in probe.named_buffers()}
    with torch.no_grad():
        probe(torch.zeros_like(example))
    return [name for name, buffer in probe.named_buffers() if buffer._version != before.get(name)]


def in_place_buffer_error(model: nn.Module, example: torch.Tensor, error: RuntimeError) -> InPlaceBufferError:
    """The one-line error for torch.func's `error`, naming the module and buffer written."""
    written = buffers_written_in_place(model, example)
    if not written:
        return InPlaceBufferError(
            f"the model writes a tensor in place in its forward ({str(error).splitlines()[0]}): per-example "
            "gradients need a forward without in-place writes to tensors it does not compute"
        )
    module, _, buffer = written[0].rpartition(".")
    return InPlaceBufferError(
        f"module {module or 'the model'!r} writes its buffer {buffer!r} in place in its forward "
        f"({type(model.get_submodule(module)).__name__}): DP-SGD cannot train it (per-example gradients refuse the "
        "write, and the buffer would record the private batches); keep that state out of the forward, or replace "
        "the module"
    )
