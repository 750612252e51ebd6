"""Opacus 1.6 PrivacyEngine arguments that equiconvert's make_private maps or refuses (docs/make-private.md's table).

An Opacus script runs after swapping its import only if every argument it passes is either served (mapped onto
book-keeping or ghost clipping, flat clipping and secret randomness) or refused here with one line saying why and
what to do, never with a bare TypeError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError


class OpacusArgumentError(UsageError, ValueError):
    """An Opacus PrivacyEngine argument equiconvert does not support; the message says why and what to do."""


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
