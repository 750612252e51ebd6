"""The run-time half of the buffer check: no training forward (or backward) may leave the model's untrained state
other than a random input would.

The untrained state is every buffer and every frozen parameter (requires_grad=False): the DP step trains neither,
so whatever a forward, a backward hook or an in-place write puts there is released without clipping or noise.
dp_safety's probe runs the model once, before training, on random batches of a few sizes. A module can
still write that state only on batches it did not draw (an example count above some size, a value of the
data), or only under grad, or in a backward hook: the probe alone could be dodged. The guard watches every
private training forward of the model being trained (with its backward: DPTrainer's per-example gradient
computation, make_private's optimizer step), so such a module cannot pass:
- where the probe saw no forward write a buffer, every buffer and frozen parameter must keep the value it had
  at the first guarded forward (one copy of them, compared after each forward);
- where the probe saw forward set buffers the same way for any input (a cache built from constants or
  parameters), a shadow copy of the model, given the model's parameters and buffers before each forward,
  runs one forward on one random example from a secret seed, and every buffer and frozen parameter must then
  equal the shadow's: they may change in training only as they would on an input that is not the private batch.
A tensor found different is set back to the expected value before the error (so the model never holds
it) and PrivacyValidationError names the module, the buffer and what to do. Costs: one comparison of the
buffers per forward; with a shadow, a copy of the model and a forward of one example per forward.

`deferred=True` (DPTrainer) keeps the comparisons on the device and waits for them only at `verify()`, which the
trainer calls wherever it waits for the device anyway and before anything leaves it (a logged record, an
evaluation, a checkpoint, the end of fit): the training loop stays free of host synchronisations, and no value
of a changed buffer is ever written out.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Collection, Iterator

import torch
from torch import nn

from .dp_safety import fixed_rng, secret_generator
from .validate import PrivacyValidationError

Buffers = dict[str, torch.Tensor]


class BufferGuard:
    """Refuses a training forward of `model` that changes a buffer or frozen parameter otherwise than one on a
    random input would.

    set_once: the buffers dp_safety.probe_dp_safety found that forward sets the same way for any input.
    """

    def __init__(self, model: nn.Module, set_once: Collection[str] = (), *, deferred: bool = False) -> None:
        self._model = model
        self._deferred = deferred
        self._pending: list[torch.Tensor] = []  # deferred: device flags "every buffer as expected" not yet read
        self._shadow = copy.deepcopy(model).train() if set_once else None
        self._expected: Buffers | None = None  # the buffers the model must hold between guarded forwards
        self._generator = secret_generator()

    @contextlib.contextmanager
    def watch(self, inputs: torch.Tensor) -> Iterator[None]:
        """Around one training forward (or one per-sample gradient computation) of the model on `inputs`
        (rows, ...): refuses what it did to the buffers once it returns."""
        self._before()
        yield
        self._after(inputs)

    def attach(self) -> None:
        """Watch every training forward through the model's own forward hooks (for a loop equiconvert does not
        run, e.g. Opacus' GradSampleModule)."""

        def before(module: nn.Module, args: tuple) -> None:
            if module.training:
                self._before()

        def after(module: nn.Module, args: tuple, output: object) -> None:
            if module.training:
                self._after(args[0] if args and isinstance(args[0], torch.Tensor) else None)

        self._model.register_forward_pre_hook(before)
        self._model.register_forward_hook(after)

    def _before(self) -> None:
        if self._expected is None:
            self._expected = _copied(self._model)
        self._check("between two training forwards")
        if self._shadow is not None:  # the shadow starts where the model is: its parameters (trained) and buffers
            with torch.no_grad():
                for name, param in self._shadow.named_parameters():
                    param.copy_(self._model.get_parameter(name))
            _assign(self._shadow, self._expected)

    def _after(self, inputs: torch.Tensor | None) -> None:
        """The buffers must be as the shadow's after a forward of its own; with no input to shape one, unchanged."""
        if self._shadow is not None and inputs is not None:
            example = torch.randn((1, *inputs.shape[1:]), generator=self._generator, dtype=torch.float64)
            example = example.to(inputs.device, inputs.dtype if inputs.is_floating_point() else torch.float32)
            self._shadow.train()
            with fixed_rng(inputs.device), torch.no_grad():
                self._shadow(example)
            self._expected = _copied(self._shadow)
        self._check("in a training forward")

    def check(self, when: str) -> None:
        """Refuse (or, deferred, queue) a change of the untrained state since the last guarded forward, e.g. by a
        backward hook: make_private calls it before each optimizer step takes the recorded gradients."""
        if self._expected is not None:
            self._check(when)

    def verify(self) -> None:
        """Raise for any change found by the comparisons queued since the last call (deferred mode: one wait)."""
        if not self._pending:
            return
        flags, self._pending = self._pending, []
        device = flags[0].device
        if not bool(torch.stack([flag.to(device) for flag in flags]).all()):
            self._refuse("in a training forward")

    def _check(self, when: str) -> None:
        flag = _same_flag(self._expected, untrained_state(self._model))
        if isinstance(flag, torch.Tensor) and self._deferred:
            self._pending.append(flag)
        elif not (isinstance(flag, torch.Tensor) and bool(flag)):
            self._refuse(when)

    def _refuse(self, when: str) -> None:
        expected = self._expected
        current = untrained_state(self._model)
        changed = [name for name in {**expected, **current} if not _all_same(_one(expected, name), _one(current, name))]
        changed = changed or ["<a buffer, changed and changed back since>"]  # deferred: seen earlier, not now
        _assign(self._model, expected)
        raise PrivacyValidationError(_message(self._model, changed, when, self._shadow is not None))


def untrained_state(model: nn.Module) -> Buffers:
    """Every tensor of `model` that the DP step does not train, by name: its buffers and frozen parameters."""
    frozen = {name: param for name, param in model.named_parameters() if not param.requires_grad}
    return {**dict(model.named_buffers()), **frozen}


def _copied(model: nn.Module) -> Buffers:
    return {name: tensor.detach().clone() for name, tensor in untrained_state(model).items()}


def _one(buffers: Buffers, name: str) -> Buffers:
    return {name: buffers[name]} if name in buffers else {}


def _all_same(expected: Buffers, current: Buffers) -> bool:
    """Whether the two sets of buffers are equal (NaN equal to NaN), waiting for the device once."""
    flag = _same_flag(expected, current)
    return isinstance(flag, torch.Tensor) and bool(flag)


def _same_flag(expected: Buffers, current: Buffers) -> torch.Tensor | bool:
    """A device bool "the two sets of buffers are equal" (NaN equal to NaN), computed without waiting for the
    device; False at once where their names, shapes, dtypes or devices differ."""
    if expected.keys() != current.keys():
        return False
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for name, a in expected.items():
        b = current[name]
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        same = a == b
        if a.is_floating_point() or a.is_complex():
            same |= a.isnan() & b.isnan()
        flags.setdefault(a.device, []).append(same.all())
    if not flags:
        return torch.ones((), dtype=torch.bool)
    first = next(iter(flags))
    return torch.stack([torch.stack(device_flags).all().to(first) for device_flags in flags.values()]).all()


def _assign(model: nn.Module, state: Buffers) -> None:
    """Set `model`'s buffers and frozen parameters to `state` (in place where the shapes agree); drop the buffers it
    has in excess."""
    with torch.no_grad():
        for name, _ in list(model.named_buffers()):
            if name not in state:
                owner, _, attribute = name.rpartition(".")
                del model.get_submodule(owner)._buffers[attribute]
        for name, value in state.items():
            owner, _, attribute = name.rpartition(".")
            module = model.get_submodule(owner)
            table = module._parameters if attribute in module._parameters else module._buffers
            current = table.get(attribute)
            if isinstance(current, torch.Tensor) and current.shape == value.shape and current.dtype == value.dtype:
                current.copy_(value)
            elif table is module._parameters:
                table[attribute] = nn.Parameter(value.clone(), requires_grad=False)
            else:
                table[attribute] = value.clone()


def _message(model: nn.Module, changed: list[str], when: str, shadowed: bool) -> str:
    owner, _, attribute = changed[0].rpartition(".")
    kind = "frozen parameter" if attribute in getattr(_owner(model, owner), "_parameters", {}) else "buffer"
    reference = "a forward on one random example would leave it" if shadowed else "it was before training"
    return (
        f"module {owner or '<root>'!r} changed its {kind} {attribute!r} {when}, otherwise than {reference} (of "
        f"{len(changed)}: {changed[:5]}): its value depends on the private batch (its examples or their number) "
        "and would be released without clipping or noise; it has been set back. Stop the model writing buffers "
        "or frozen parameters from its input (in forward or in backward hooks): compute such values from "
        "parameters or constants only, or keep them outside the model."
    )


def _owner(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
