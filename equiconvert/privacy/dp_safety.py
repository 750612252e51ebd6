"""Behavioural DP-safety probes: what a model does in a train-mode forward, not what its layers are called.

Three ways a model breaks DP-SGD's per-example analysis whatever its layers' names:
- a buffer (or parameter) that a forward writes from its input (running statistics under any name,
  a count of the examples seen, data-dependent initialisation such as ActNorm's) holds statistics of
  private data without clipping or noise, then released;
- a buffer that every forward changes, even the same way for any input (a count of forwards): the
  number of forwards per step follows the secret batch size (physical chunks, empty batches);
- a forward that mixes examples (`x - x.mean(0)`, `F.batch_norm(training=True)`, `x + x.cumsum(0)`)
  makes an example's output, hence its "per-example" gradient, depend on others; the per-example
  back-ends (vmap, book-keeping, Opacus' grad samplers) would compute gradients of another function.

The probe runs once per front-end on ONE copy of the model (on its device, in train mode, under grad with
its parameters detached, so a forward takes its training code path but builds no graph, with fixed dropout
masks), with random inputs drawn from a secret seed so that a module cannot recognise them, its tensors set
back to their initial values before each run:
- three forwards of `batch_size` rows, the largest batch training runs: a base batch, the base with
  its first, middle and last examples replaced, and the base with all the others replaced. At every
  module, the examples not replaced must keep their outputs: mixing in either direction (an example
  depending on earlier or on later ones) at the size that runs is refused;
- after each of those forwards the buffers must equal those left by a forward of 1 example: what a
  buffer holds may depend neither on the examples nor on their number; and a second forward (of 3)
  must leave them as the first did.
The caller's model and RNG state are left as they were. A buffer or frozen parameter written only on batches
the probe did not draw, or in a backward hook, is refused at run time by the guard on the model being trained
(buffer_guard.py); the cross-example half runs again at each new physical batch shape (ExamplesApartProbe).
The probe catches batch dependence a model has by accident; it is no defence against code written to evade it
(docs/privacy.md's threat model).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .validate import PrivacyValidationError, validate_dp_safe

PROBE_BATCH = 3  # the fewest rows with a first, a middle and a last example
_WHOLE_WIDTH = 1 << 16  # elements per projection of a whole buffer or parameter (bounds the random vectors kept)
_ULPS = 64  # an example's output may move by this many units in the last place of its norm (kernel rounding)


def device_of(model: nn.Module) -> torch.device:
    """Where the model's tensors are (cpu for a model without any)."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor.device
    return torch.device("cpu")


@contextlib.contextmanager
def fixed_rng(device: torch.device) -> Iterator[None]:
    """The caller's CPU (and this CUDA device's) RNG state untouched; inside, seeded to the same value each time."""
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(0)
        if cuda:
            with torch.cuda.device(cuda[0]):
                torch.cuda.manual_seed(0)
        yield


def secret_generator() -> torch.Generator:
    """A CPU generator from a secret seed: inputs a module cannot predict and so cannot recognise."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def _tensor_of(output: Any) -> torch.Tensor | None:
    """The batched tensor of a module's output (a tensor, or escnn's GeometricTensor), else None."""
    if isinstance(output, torch.Tensor):
        return output
    inner = getattr(output, "tensor", None)
    return inner if isinstance(inner, torch.Tensor) else None


class _Fingerprints:
    """Small summaries of tensors, equal for equal values and different otherwise (with probability one):
    a projection on a random unit vector and the norm, per example (rows) or of a whole tensor."""

    def __init__(self, generator: torch.Generator) -> None:
        self._generator = generator
        self._directions: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _direction(self, width: int, device: torch.device) -> torch.Tensor:
        key = (width, device)
        if key not in self._directions:
            vector = torch.randn(width, generator=self._generator, dtype=torch.float64)
            self._directions[key] = (vector / vector.norm().clamp_min(1e-300)).to(device, _summary_dtype(device))
        return self._directions[key]

    def rows(self, value: Any, rows: int) -> torch.Tensor | None:
        """(2, rows) of a batched float tensor with `rows` examples, else None."""
        tensor = _tensor_of(value)
        if tensor is None or tensor.dim() == 0 or tensor.shape[0] != rows or not tensor.is_floating_point():
            return None
        flat = tensor.detach().reshape(rows, -1).to(_summary_dtype(tensor.device))
        return torch.stack((flat @ self._direction(flat.shape[1], flat.device), flat.norm(dim=1)))

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """Of a whole tensor: one projection per _WHOLE_WIDTH elements, and the norm (on the CPU)."""
        flat = tensor.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        flat = flat.to(_summary_dtype(flat.device))
        width = min(max(flat.numel(), 1), _WHOLE_WIDTH)
        pieces = torch.nn.functional.pad(flat, (0, -flat.numel() % width)).reshape(-1, width)
        return torch.cat((pieces @ self._direction(width, flat.device), flat.norm().reshape(1))).cpu()


def _summary_dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64


# module path, fingerprints of its batched input (if any) and of its output
Record = tuple[str, torch.Tensor | None, torch.Tensor]


def _forward(model: nn.Module, inputs: torch.Tensor, prints: _Fingerprints) -> list[Record]:
    """Train-mode forward with fixed dropout masks; every module's batched input and output fingerprints, in
    completion order."""
    rows = inputs.shape[0]
    records: list[Record] = []

    def hook(name: str):
        def record(module: nn.Module, args: tuple, output: Any) -> None:
            summary = prints.rows(output, rows)
            if summary is not None:
                records.append((name, prints.rows(args[0], rows) if args else None, summary))

        return record

    handles = [m.register_forward_hook(hook(name or "<root>")) for name, m in model.named_modules()]
    try:
        with fixed_rng(inputs.device), torch.enable_grad():  # as in training: a module may write only under grad
            model(inputs)
    finally:
        for handle in handles:
            handle.remove()
    return records


State = dict[str, tuple[str, torch.Tensor, tuple[int, ...], torch.dtype]]  # path -> (kind, fingerprint, shape, dtype)


def _state(model: nn.Module, prints: _Fingerprints) -> State:
    """Every buffer and parameter of `model` by path, as it is now (fingerprints, not copies)."""
    tensors = itertools.chain(
        (("buffer", n, b) for n, b in model.named_buffers()), (("parameter", n, p) for n, p in model.named_parameters())
    )
    return {name: (kind, prints.whole(t), tuple(t.shape), t.dtype) for kind, name, t in tensors}


def _differs(a: State, b: State, name: str) -> bool:
    x, y = a.get(name), b.get(name)
    if x is None or y is None or x[2:] != y[2:]:
        return True
    return not torch.equal(x[1], y[1]) and not torch.allclose(x[1], y[1], rtol=0.0, atol=0.0, equal_nan=True)


class _Snapshot:
    """The copy's tensors as it was made, to set it back before each probe run (no second copy of the model)."""

    def __init__(self, model: nn.Module) -> None:
        self._buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        self._parameters = {name: p.detach().clone() for name, p in model.named_parameters()}

    def restore(self, model: nn.Module) -> None:
        with torch.no_grad():
            for name, _ in list(model.named_buffers()):
                if name not in self._buffers:  # registered by a forward: gone again
                    owner, _, attribute = name.rpartition(".")
                    del model.get_submodule(owner)._buffers[attribute]
            for table, saved in ((model.get_buffer, self._buffers), (model.get_parameter, self._parameters)):
                for name, value in saved.items():
                    _set(model, name, table, value)


def _set(model: nn.Module, name: str, get: Any, value: torch.Tensor) -> None:
    owner, _, attribute = name.rpartition(".")
    module = model.get_submodule(owner)
    try:
        current = get(name)
    except AttributeError:
        current = None
    if isinstance(current, torch.Tensor) and current.shape == value.shape and current.dtype == value.dtype:
        current.copy_(value)
    elif attribute in module._parameters:
        module._parameters[attribute] = nn.Parameter(value.clone(), requires_grad=value.requires_grad)
    else:
        module._buffers[attribute] = value.clone()


def _refuse_lazy(model: nn.Module) -> None:
    lazy = [name for name, p in model.named_parameters() if is_lazy(p)]
    if lazy:  # materialised by the first forward with a fresh random init, which probe runs would not share
        raise PrivacyValidationError(
            f"parameter {lazy[0]!r} is uninitialised (a lazy module): run the model once on a zero input of the "
            "data's shape before DP training, so that its shapes and initial values are fixed"
        )


def _ends(rows: int) -> list[int]:
    """The first and last rows, and the middle one where at least two others remain (of 2 rows: the last, so
    that each of the two is replaced while the other is watched)."""
    if rows == 2:
        return [1]
    return sorted({0, rows - 1} | ({rows // 2} if rows >= 5 else set()))


class _Probe:
    """One copy of the model for probe runs (train mode, under grad with its parameters detached, so a forward
    runs its training code path), inputs from a secret seed shaped like one example, its tensors set back before
    each run."""

    def __init__(self, model: nn.Module, example_input: torch.Tensor) -> None:
        _refuse_lazy(model)
        self.model = copy.deepcopy(model).train().requires_grad_(False)
        self.device = device_of(self.model)
        self.dtype = example_input.dtype if example_input.is_floating_point() else torch.get_default_dtype()
        self.example_shape = tuple(example_input.shape[1:])  # one example's
        self._generator = secret_generator()
        self.prints = _Fingerprints(self._generator)
        self.snapshot = _Snapshot(self.model)

    def draw(self, count: int) -> torch.Tensor:
        return torch.randn((count, *self.example_shape), generator=self._generator, dtype=self.dtype).to(self.device)

    def run(self, batch: torch.Tensor) -> list[Record]:
        """A forward from the copy's initial state."""
        self.snapshot.restore(self.model)
        return _forward(self.model, batch, self.prints)

    def mixing_batches(self, rows: int) -> tuple[list[int], list[int], list[torch.Tensor]]:
        """The replaced rows, the others, and three batches: a base, the base with the replaced rows drawn anew,
        and the base with the others drawn anew."""
        ends = _ends(rows)
        others = [row for row in range(rows) if row not in ends]
        base = self.draw(rows)
        few, rest = base.clone(), base.clone()
        few[ends] = self.draw(len(ends))
        rest[others] = self.draw(len(others))
        return ends, others, [base, few, rest]

    def refuse_mixing(self, outputs: list[list[Record]], ends: list[int], others: list[int]) -> None:
        tolerance = _ULPS * torch.finfo(self.dtype).eps
        _refuse_mixing(outputs[0], outputs[1], others, ends, tolerance)
        _refuse_mixing(outputs[0], outputs[2], ends, others, tolerance)


def probe_dp_safety(model: nn.Module, example_input: torch.Tensor, batch_size: int | None = None) -> frozenset[str]:
    """Refuse (PrivacyValidationError) buffers written from the input or on every forward, and mixed examples.

    example_input: a batch (B, ...) of inputs as the model takes them (only its per-example shape, dtype
    and device are used). batch_size: rows of the largest batch the model takes in one training forward
    (physical batch times views per example); default B, at least PROBE_BATCH. See the module docstring.
    Returns the buffers and frozen parameters that forward sets once, the same way for any input (a cache built
    from constants or parameters): the run-time guard (buffer_guard.BufferGuard) replays their updates.
    """
    rows = max(batch_size or example_input.shape[0], PROBE_BATCH)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    probe = _Probe(model, example_input)
    initial = _state(probe.model, probe.prints)
    ends, others, batches = probe.mixing_batches(rows)
    outputs: list[list[Record]] = []
    after_one: list[State] = []
    for batch in batches:
        outputs.append(probe.run(batch))
        after_one.append(_state(probe.model, probe.prints))
    probe.run(probe.draw(1))
    small_one = _state(probe.model, probe.prints)
    _forward(probe.model, probe.draw(PROBE_BATCH), probe.prints)
    history = [initial, small_one, _state(probe.model, probe.prints)]  # as given, after one forward, after two

    _refuse_input_dependent([(state, small_one) for state in after_one], history)
    _refuse_forward_counters(history[1], history[2])
    probe.refuse_mixing(outputs, ends, others)
    return frozenset(
        name
        for name, entry in initial.items()
        if (entry[0] == "buffer" or name in frozen) and _differs(initial, after_one[0], name)
    )


class ExamplesApartProbe:
    """The probe's cross-example half, to run again at other batch sizes: refuses a module whose output for an
    example moves when other examples of a batch of that size change. One copy of the model is made at the start
    and given the model's current tensors before each run; the front-ends run it at each physical batch shape the
    first time training runs it (shape_probe.py), since a module may mix at some sizes only.

    example_input: a batch shaped like the model's input (only its per-example shape, dtype and device are used).
    """

    def __init__(self, model: nn.Module, example_input: torch.Tensor) -> None:
        self._model = model
        self._probe = _Probe(model, example_input)

    def check(self, shape: tuple[int, ...]) -> None:
        """Raise PrivacyValidationError if the model, as it is now, mixes the examples of an input of `shape`
        (rows, ...)."""
        rows = shape[0]
        if rows < 2:
            return  # one example: nothing to mix with
        self._probe.snapshot = _Snapshot(self._model)  # the runs start from the model's current tensors
        self._probe.example_shape = tuple(shape[1:])
        ends, others, batches = self._probe.mixing_batches(rows)
        self._probe.refuse_mixing([self._probe.run(batch) for batch in batches], ends, others)


def _refuse_input_dependent(pairs: Sequence[tuple[State, State]], history: list[State]) -> None:
    """Refuse what differs between runs on batches of other examples and sizes."""
    names = list({name: None for a, b in pairs for name in {**a, **b}})
    dependent = [name for name in names if any(_differs(a, b, name) for a, b in pairs)]
    if dependent:
        kind = next(state[dependent[0]][0] for state in history if dependent[0] in state)
        raise PrivacyValidationError(_input_dependent_message(dependent, kind, history))


def _input_dependent_message(names: list[str], kind: str, history: list[State]) -> str:
    """The refusal of the first of `names` (a `kind`), saying whether forward initialises it or updates it.

    history: the state as given, after one forward, after two.
    """
    name = names[0]
    owner, _, attribute = name.rpartition(".")
    set_once = _differs(history[0], history[1], name) and not _differs(history[1], history[2], name)
    how = (
        "it is set from the input of the first forward (data-dependent initialisation, e.g. ActNorm)"
        if set_once
        else "it is updated from the input of every forward (running statistics), its values or its number of "
        "examples (a count)"
    )
    return (
        f"module {owner or '<root>'!r} changes its {kind} {attribute!r} from its input in a forward pass: {how} "
        f"(of {len(names)} input-dependent: {names[:5]}). Statistics of private data would be written without "
        "clipping or noise and released with the weights. Compute them from parameters or inputs of the same "
        "example only, initialise them before training from parameters or public data (and stop forward "
        "writing them), or register them as non-persistent constants that forward does not write."
    )


def _refuse_forward_counters(after_one: State, after_two: State) -> None:
    """Refuse state that every forward changes: it counts forwards, whose number per step follows the batch size."""
    counters = [name for name in after_one if _differs(after_one, after_two, name)]
    if counters:
        kind, name = after_one[counters[0]][0], counters[0]
        owner, _, attribute = name.rpartition(".")
        raise PrivacyValidationError(
            f"module {owner or '<root>'!r} changes its {kind} {attribute!r} in every forward (of {len(counters)}: "
            f"{counters[:5]}): it counts forwards, and the number of forwards in a step follows the secret batch "
            "size (physical batches, empty batches), so it would be released without noise. Keep counts outside "
            "the model (e.g. the training loop's step), or stop forward writing it."
        )


def _moved(before: torch.Tensor, after: torch.Tensor, rows: list[int], tolerance: float) -> int | None:
    """The first of `rows` whose fingerprint moved between two runs, else None."""
    if before.shape != after.shape:
        return None
    scale = torch.maximum(before[1, rows], after[1, rows]) * tolerance
    moved = ((before[:, rows] - after[:, rows]).abs() > scale).any(0)
    return rows[int(moved.nonzero()[0])] if bool(moved.any()) else None


def _refuse_mixing(
    before: list[Record], after: list[Record], kept: list[int], replaced: list[int], tolerance: float
) -> None:
    """Refuse the first module whose output for a kept example moved when the `replaced` examples changed.

    Names the first module (in the order modules finish their forward) whose output moved or, where its input
    moved already, the module whose own forward code mixed them before calling it.
    """
    if not kept:
        return
    for (name, input_a, a), (other, input_b, b) in zip(before, after):
        if name != other:
            return  # the two forwards ran different modules: nothing more lines up
        row = _moved(a, b, kept, tolerance)
        if row is None:
            continue
        if input_a is not None and input_b is not None and _moved(input_a, input_b, kept, tolerance) is not None:
            name = (name.rpartition(".")[0] or "<root>") if name != "<root>" else name
        raise PrivacyValidationError(
            f"module {name!r} mixes examples: in a batch of {len(kept) + len(replaced)}, its output for example "
            f"{row} changes when examples {_listing(replaced)} change (batch statistics, e.g. x - x.mean(0), "
            "F.batch_norm(training=True), or x.cumsum(0)), so per-example gradients are not per-example. "
            "Normalise each example on its own (GroupNorm, LayerNorm) and compute nothing across the batch."
        )


def _listing(rows: list[int]) -> str:
    return ", ".join(map(str, rows)) if len(rows) <= 3 else f"{rows[0]}..{rows[-1]} (all but the first, middle, last)"


def check_dp_safe(model: nn.Module, example_input: torch.Tensor, batch_size: int | None = None) -> frozenset[str]:
    """Raise PrivacyValidationError unless DP-SGD can train `model` privately.

    example_input: a batch (B, ...) of inputs as the model takes them (values do not matter; only the
    shape of one example, its dtype and device are used). batch_size: rows of the largest batch training
    runs through the model at once (default B). Runs the name-based check (validate_dp_safe: batch norms,
    running-statistics buffers), then the behavioural probe (probe_dp_safety), and returns its result.
    """
    validate_dp_safe(model)
    return probe_dp_safety(model, example_input, batch_size)
