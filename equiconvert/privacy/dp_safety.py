"""Behavioural DP-safety probes: what a model does in a train-mode forward, not what its layers are called.

Two ways a model breaks DP-SGD's per-example analysis whatever its layers' names:
- a buffer that a forward pass changes (running statistics under any name) is
  updated from private data without clipping or noise, then released;
- a forward that mixes examples (`x - x.mean(0)`, `F.batch_norm(training=True)`)
  makes an example's output, hence its "per-example" gradient, depend on others.
Both probes run on a float64 CPU copy of the model with random inputs shaped like
the example; the caller's model and RNG state are left as they were.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch
from torch import nn

from .validate import PrivacyValidationError, validate_dp_safe

PROBE_BATCH = 3
_RTOL, _ATOL = 1e-9, 1e-12


def _probe_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).to(device="cpu", dtype=torch.float64).train()


def _tensor_of(output: Any) -> torch.Tensor | None:
    """The batched tensor of a module's output (a tensor, or escnn's GeometricTensor), else None."""
    if isinstance(output, torch.Tensor):
        return output
    inner = getattr(output, "tensor", None)
    return inner if isinstance(inner, torch.Tensor) else None


Record = tuple[str, torch.Tensor | None, torch.Tensor]  # module path, its batched input (if any), its output


def _batched(value: Any, batch: int) -> torch.Tensor | None:
    tensor = _tensor_of(value)
    return tensor.detach().clone() if tensor is not None and tensor.dim() > 0 and tensor.shape[0] == batch else None


def _forward(model: nn.Module, inputs: torch.Tensor) -> list[Record]:
    """Train-mode forward with fixed dropout masks; every module's batched input and output, in completion order."""
    outputs: list[Record] = []

    def hook(name: str):
        def record(module: nn.Module, args: tuple, output: Any) -> None:
            tensor = _batched(output, inputs.shape[0])
            if tensor is not None:
                outputs.append((name, _batched(args[0], inputs.shape[0]) if args else None, tensor))

        return record

    handles = [m.register_forward_hook(hook(name or "<root>")) for name, m in model.named_modules()]
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(0)
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def _random_batch(example_input: torch.Tensor) -> Iterator[torch.Tensor]:
    """Two batches of PROBE_BATCH random inputs shaped like one example, equal in example 0 only."""
    shape = tuple(example_input.shape[1:])
    generator = torch.Generator().manual_seed(0)
    first = torch.randn(PROBE_BATCH, *shape, generator=generator, dtype=torch.float64)
    second = first.clone()
    second[1:] = torch.randn(PROBE_BATCH - 1, *shape, generator=generator, dtype=torch.float64)
    yield first
    yield second


def _same_example(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether example 0 of two batches is the same (the probe runs in float64)."""
    return a.shape == b.shape and torch.allclose(a[0], b[0], rtol=_RTOL, atol=_ATOL)


def check_buffers_unchanged(model: nn.Module, example_input: torch.Tensor) -> None:
    """Refuse any buffer that a train-mode forward changes, naming its module and buffer."""
    probe = _probe_copy(model)
    first, second = _random_batch(example_input)
    _forward(probe, first)  # buffers filled lazily from parameters settle here
    before = {name: b.detach().clone() for name, b in probe.named_buffers()}
    _forward(probe, second)
    changed = [
        name
        for name, b in probe.named_buffers()
        if name in before and not (b.shape == before[name].shape and torch.equal(b, before[name]))
    ]
    if changed:
        owner, _, buffer = changed[0].rpartition(".")
        raise PrivacyValidationError(
            f"module {owner or '<root>'!r} changes its buffer {buffer!r} in a forward pass (of {len(changed)} changed: "
            f"{changed[:5]}): statistics of private data would be updated without noise and released with the "
            "weights. Compute them from parameters or inputs of the same example only, or register them as "
            "non-persistent constants that forward does not write."
        )


def check_examples_independent(model: nn.Module, example_input: torch.Tensor) -> None:
    """Refuse a model whose train-mode output for one example changes when another example of the batch does.

    Names the first module (in the order modules finish their forward) whose output for example 0 changes or,
    where its input changed already, the module whose own forward code mixed them before calling it.
    """
    probe = _probe_copy(model)
    first, second = _random_batch(example_input)
    before, after = _forward(probe, first), _forward(probe, second)
    for (name, input_a, a), (_, input_b, b) in zip(before, after):
        if a.shape == b.shape and not _same_example(a, b):
            if input_a is not None and input_b is not None and not _same_example(input_a, input_b):
                name = (name.rpartition(".")[0] or "<root>") if name != "<root>" else name
            raise PrivacyValidationError(
                f"module {name!r} mixes examples: its output for one example changes when another example of the "
                "batch changes (batch statistics, e.g. x - x.mean(0) or F.batch_norm(training=True)), so per-example "
                "gradients are not per-example. Normalise each example on its own (GroupNorm, LayerNorm)."
            )


def check_dp_safe(model: nn.Module, example_input: torch.Tensor) -> None:
    """Raise PrivacyValidationError unless DP-SGD can train `model` privately.

    example_input: a batch (B, ...) of inputs as the model takes them (values do not matter; only
    the shape of one example is used). Runs the name-based check (validate_dp_safe: batch norms,
    running-statistics buffers), then the two behavioural probes of this module.
    """
    validate_dp_safe(model)
    check_buffers_unchanged(model, example_input)
    check_examples_independent(model, example_input)
