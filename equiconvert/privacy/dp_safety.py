"""Behavioural DP-safety probes: what a model does in a train-mode forward, not what its layers are called.

Two ways a model breaks DP-SGD's per-example analysis whatever its layers' names:
- a buffer (or parameter) that a forward pass writes from its input (running statistics
  under any name, data-dependent initialisation such as ActNorm's) holds statistics of
  private data without clipping or noise, then released;
- a forward that mixes examples (`x - x.mean(0)`, `F.batch_norm(training=True)`)
  makes an example's output, hence its "per-example" gradient, depend on others.
Both probes run on float64 CPU copies of the model with random inputs shaped like
the example; the caller's model and RNG state are left as they were.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn.parameter import is_lazy

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


def _independent_batches(example_input: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`count` batches of PROBE_BATCH random inputs shaped like one example, no two examples alike."""
    generator = torch.Generator().manual_seed(1)
    shape = (PROBE_BATCH, *example_input.shape[1:])
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(count)]


State = dict[str, tuple[str, torch.Tensor]]  # path -> ("buffer" or "parameter", its value)


def _state(model: nn.Module) -> State:
    """Every buffer and parameter of `model` by path, with its kind, as it is now."""
    buffers = {name: ("buffer", b.detach().clone()) for name, b in model.named_buffers()}
    return buffers | {name: ("parameter", p.detach().clone()) for name, p in model.named_parameters()}


def _differs(a: State, b: State, name: str) -> bool:
    x, y = a.get(name), b.get(name)
    if x is None or y is None or x[1].shape != y[1].shape:
        return True
    same_nan = x[1].is_floating_point() and torch.allclose(x[1], y[1], rtol=0.0, atol=0.0, equal_nan=True)
    return not (torch.equal(x[1], y[1]) or same_nan)


def check_buffers_unchanged(model: nn.Module, example_input: torch.Tensor) -> None:
    """Refuse any buffer (or parameter) whose value after train-mode forwards depends on the inputs.

    Two copies of the model, fresh as given, each run two forwards on their own random batches; whatever
    ends up different between the copies was written from the inputs: running statistics under any name,
    and data-dependent initialisation on the first forward (ActNorm). State that forward changes the same
    way for any input (a step counter, a cache built from parameters) is allowed.
    """
    lazy = [name for name, p in model.named_parameters() if is_lazy(p)]
    if lazy:  # materialised by the first forward with a fresh random init, which the copies would not share
        raise PrivacyValidationError(
            f"parameter {lazy[0]!r} is uninitialised (a lazy module): run the model once on a zero input of the "
            "data's shape before DP training, so that its shapes and initial values are fixed"
        )
    copies = (_probe_copy(model), _probe_copy(model))
    initial = _state(copies[0])
    batches = iter(_independent_batches(example_input, 2 * len(copies)))
    pairs: list[tuple[State, State]] = []  # the two copies' states after one forward, after two
    for _ in range(2):
        for probe in copies:
            _forward(probe, next(batches))
        pairs.append((_state(copies[0]), _state(copies[1])))
    for first, second in pairs:
        either = {**second, **first}
        dependent = [name for name in either if _differs(first, second, name)]
        if dependent:
            history = [initial, pairs[0][0], pairs[1][0]]
            raise PrivacyValidationError(_input_dependent_message(dependent, either[dependent[0]][0], history))


def _input_dependent_message(names: list[str], kind: str, history: list[State]) -> str:
    """The refusal of the first of `names` (a `kind`), saying whether forward initialises it or updates it.

    history: the first copy's state as given, after one forward, after two.
    """
    name = names[0]
    owner, _, attribute = name.rpartition(".")
    set_once = _differs(history[0], history[1], name) and not _differs(history[1], history[2], name)
    how = (
        "it is set from the input of the first forward (data-dependent initialisation, e.g. ActNorm)"
        if set_once
        else "it is updated from the input of every forward (running statistics)"
    )
    return (
        f"module {owner or '<root>'!r} changes its {kind} {attribute!r} from its input in a forward pass: {how} "
        f"(of {len(names)} input-dependent: {names[:5]}). Statistics of private data would be written without "
        "clipping or noise and released with the weights. Compute them from parameters or inputs of the same "
        "example only, initialise them before training from parameters or public data (and stop forward "
        "writing them), or register them as non-persistent constants that forward does not write."
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
