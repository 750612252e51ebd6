"""Opacus 1.6 arguments and attributes that equiconvert's make_private maps or refuses (docs/make-private.md's table).

An Opacus script runs after swapping its import only if every argument it passes, and every method or attribute of
the returned module, optimizer and loader it uses, is either served (mapped onto book-keeping or ghost clipping,
flat clipping and secret randomness) or refused here with one line saying why and what to do, never with a bare
TypeError or AttributeError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError


class OpacusArgumentError(UsageError, ValueError):
    """An Opacus PrivacyEngine argument equiconvert does not support; the message says why and what to do."""


class OpacusAttributeError(UsageError, AttributeError):
    """An Opacus method or attribute the returned objects do not have; the message says why and what to do.

    An AttributeError, so that `hasattr` stays False for it, as for any attribute an object does not have."""


# Opacus arguments served at one value only: that value (also make_private's default), and why no other
ACCEPTED: dict[str, Any] = {
    "clipping": "flat",
    "batch_first": True,
    "poisson_sampling": True,
    "noise_generator": None,
    "wrap_model": True,
    "rand_on_empty": False,
    "noise_scheduler": None,
    "grad_clip_scheduler": None,
}
_WHY: dict[str, str] = {
    "clipping": "only flat clipping (each example's whole gradient, all parameters together) is supported; "
    "pass clipping='flat' (Opacus' default)",
    "batch_first": "book-keeping takes the batch on the first dimension of the module's input; put it there "
    "(x.transpose(0, 1)) and leave batch_first=True",
    "poisson_sampling": "the accountants assume Poisson sampling, so make_private samples batches that way only; "
    "leave poisson_sampling=True",
    "noise_generator": "a given torch.Generator makes the noise seedable, and whoever knows its seed can remove the "
    "noise, so the run would not be private; leave it out (debug_seed= gives reproducible, non-private runs for tests)",
    "wrap_model": "the returned module records each layer's input for the per-example gradients: leave "
    "wrap_model=True and train the returned module",
    "rand_on_empty": "an empty Poisson batch keeps its shape with 0 rows and the step still runs; leave "
    "rand_on_empty=False",
    "noise_scheduler": "make_private's optimizer keeps one noise multiplier, the one its epsilon is computed for; "
    "leave the noise scheduler out",
    "grad_clip_scheduler": "make_private's optimizer keeps one max_grad_norm; leave the clipping scheduler out",
}


@dataclass(frozen=True)
class GradSampleMode:
    """How make_private serves one of Opacus' per-sample gradient modes."""

    method: str  # the per-example back-end (backends.py) of the returned module and optimizer
    criterion: bool  # True: (module, optimizer, criterion, data_loader) as Opacus, the criterion from dp_loss.py


# Opacus' modes: its per-example gradient modes by book-keeping's exact per-example gradients; its ghost clipping
# by ghost.py's (the same per-example norms, never every per-example gradient at once)
GRAD_SAMPLE_MODES: dict[str, GradSampleMode] = {
    "hooks": GradSampleMode("bookkeeping", criterion=False),
    "functorch": GradSampleMode("bookkeeping", criterion=False),
    "ew": GradSampleMode("bookkeeping", criterion=False),
    "ghost": GradSampleMode("ghost", criterion=True),
}
DEFAULT_GRAD_SAMPLE_MODE = "hooks"  # Opacus' default

_ADAPTIVE = "an option of clipping='adaptive', which equiconvert does not support (flat clipping only); leave it out"
_CALIBRATION = (
    "an option of Opacus' noise calibration; equiconvert calibrates with its own accountant settings (never above "
    "target_epsilon, at most 0.01 below); leave it out"
)
# keywords Opacus forwards through **kwargs (to its optimizer classes, or to get_noise_multiplier)
_REFUSED_KEYWORDS: dict[str, str] = {
    "target_unclipped_quantile": _ADAPTIVE,
    "clipbound_learning_rate": _ADAPTIVE,
    "max_clipbound": _ADAPTIVE,
    "min_clipbound": _ADAPTIVE,
    "unclipped_num_std": _ADAPTIVE,
    "epsilon_tolerance": _CALIBRATION,
    "alphas": _CALIBRATION,
    "eps_error": _CALIBRATION,
}


def check_opacus_arguments(given: Mapping[str, Any]) -> None:
    """Refuse, one line each, Opacus arguments equiconvert does not serve (`given`: name -> value)."""
    for name, value in given.items():
        if name in _REFUSED_KEYWORDS:
            raise OpacusArgumentError(f"{name}: {_REFUSED_KEYWORDS[name]}")
        if name in ACCEPTED and not _same(value, ACCEPTED[name]):
            raise OpacusArgumentError(f"{name}={value!r} is not supported: {_WHY[name]}")
    grad_sample_mode = given.get("grad_sample_mode", DEFAULT_GRAD_SAMPLE_MODE)
    if grad_sample_mode not in GRAD_SAMPLE_MODES:
        raise OpacusArgumentError(
            f"grad_sample_mode={grad_sample_mode!r} is not supported: choose one of {tuple(GRAD_SAMPLE_MODES)} (exact "
            "per-example gradients by book-keeping; 'ghost': ghost clipping, returning the criterion as Opacus does)"
        )
    if isinstance(given.get("max_grad_norm"), (list, tuple)):
        raise OpacusArgumentError(
            "max_grad_norm is a list (Opacus' per-layer clipping): give one number; only flat clipping is supported"
        )


def _same(value: Any, accepted: Any) -> bool:
    return value is accepted if accepted is None else (type(value) is type(accepted) and value == accepted)


_ONE_STEP = (
    "make_private's optimizer clips, adds the noise once and divides in one call (dp_step.py), so that no "
    "logical batch is noised twice or not at all; call optimizer.pre_step() (or optimizer.step())"
)
# Opacus DPOptimizer methods and attributes the returned optimizer refuses, and why
REFUSED_OPTIMIZER_ATTRIBUTES: dict[str, str] = {
    "add_noise": _ONE_STEP,
    "scale_grad": _ONE_STEP,
    "step_hook": "the optimizer keeps a list of step hooks; add one with optimizer.attach_step_hook(fn)",
    "generator": "the noise comes from a secret generator that is never exposed (whoever holds it could remove "
    "the noise); make_private(debug_seed=...) gives reproducible, non-private runs for tests",
}
ALLOW_GRAD_ACCUMULATION = (
    "make_private's module takes one training forward and backward per optimizer.step(); to accumulate "
    "physical batches of one logical batch use BatchMemoryManager (or optimizer.signal_skip_step(True) before "
    "each step but the last)"
)
GHOST_GRAD_SAMPLES = (
    "grad_sample_mode='ghost' never forms per-example gradients (only their norms and the clipped sum); use "
    "grad_sample_mode='hooks' to read them"
)
REMOVED_HOOKS = (
    "the module's hooks were removed (remove_hooks / to_standard_module); call make_private on the model again to "
    "train it privately"
)
DISABLED_HOOKS = (
    "the module's hooks are disabled (disable_hooks), so the last backward formed no per-example gradients and a "
    "private step cannot be taken; call module.enable_hooks() before the training forward"
)


def refuse_attribute(owner: str, name: str, refused: Mapping[str, str]) -> OpacusAttributeError:
    """The error for `owner.name`: its reason where Opacus has it and equiconvert refuses it, else a plain miss."""
    if name in refused:
        return OpacusAttributeError(f"{owner}.{name} is not supported: {refused[name]}")
    return OpacusAttributeError(f"{owner!r} object has no attribute {name!r}")
