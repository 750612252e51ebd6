"""Opacus-style `make_private`: the user's model, optimizer and DataLoader, made DP-SGD by book-keeping or ghost
clipping.

    model, optimizer, train_loader = make_private(module=model, optimizer=optimizer, data_loader=train_loader,
                                                  noise_multiplier=1.0, max_grad_norm=1.0)

or `PrivacyEngine().make_private(...)` with Opacus' signature, so that an Opacus script
changes only its import. The loop stays the user's: forward, `loss.backward()`,
`optimizer.step()`. Per-example gradients come from book-keeping (private_module.py)
instead of Opacus' hooks, or with grad_sample_mode="ghost" only their norms and the clipped sum, by ghost
clipping (ghost.py), which never holds every per-example gradient at once; the step from dp_optimizer.py (its
clipping and noise: dp_step.py); Poisson batches from dp_loader.py; epsilon from Opacus' accountants
(accounting.py). Opacus' other arguments are served or refused by name (opacus_parity.py); checkpoints:
engine_checkpoint.py.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import torch
from opacus.validators import ModuleValidator
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from ..errors import ParameterError
from .accounting import (
    ACCOUNTANTS,
    APPROXIMATE_ACCOUNTANT_FACTORIES,
    PrivacyLedger,
    accountant_epsilon,
    calibrate_noise_multiplier,
    check_delta_for,
    make_accountant,
    refuse_delta,
)
from .dp_loader import DPDataLoader
from .dp_loss import DPLoss
from .dp_optimizer import DPOptimizer
from .engine_checkpoint import load_engine_checkpoint, save_engine_checkpoint
from .lightning_guard import refuse_lightning_module
from .opacus_parity import ACCEPTED, DEFAULT_GRAD_SAMPLE_MODE, GRAD_SAMPLE_MODES, check_opacus_arguments
from .optimizer_params import check_optimizer_params
from .private_module import PrivateModule
from .secure_rng import NOISE, SAMPLING, make_source, warn_not_private
from .validate import PrivacyValidationError, validate_dp_safe

DEFAULT_ACCOUNTANT = "prv"  # Opacus' PrivacyEngine default: a swapped import reports the same epsilon
ENGINE_ACCOUNTANTS = ACCOUNTANTS + tuple(APPROXIMATE_ACCOUNTANT_FACTORIES)
GDP_WARNING = (
    "accountant='gdp' (Opacus' Gaussian DP accountant) is a central-limit approximation that can underestimate "
    "epsilon; accountant='prv' (the default) gives an upper bound"
)

Made = tuple[PrivateModule, DPOptimizer, DPDataLoader] | tuple[PrivateModule, DPOptimizer, DPLoss, DPDataLoader]


def _check_accountant(accountant: str) -> None:
    if accountant not in ENGINE_ACCOUNTANTS:
        raise ParameterError(f"accountant must be one of {ENGINE_ACCOUNTANTS}, got {accountant!r}")


def _planned_steps(epochs: float | None, steps: int | None, steps_per_epoch: int) -> int | None:
    if epochs is not None and steps is not None:
        raise ParameterError("give epochs or steps, not both")
    if steps is not None:
        if steps < 1:
            raise ParameterError(f"steps must be >= 1, got {steps}")
        return int(steps)
    if epochs is not None:
        if not epochs > 0:
            raise ParameterError(f"epochs must be > 0, got {epochs}")
        return int(epochs * steps_per_epoch)
    return None


def _check_loader(data_loader: DataLoader) -> None:
    """Poisson sampling draws indices of a map-style data set of known size, in batches of the loader's size."""
    dataset = data_loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise ParameterError(
            "make_private needs a map-style dataset (len() and indexing) for Poisson sampling; the data loader's "
            f"dataset is {type(dataset).__name__}: load it into a Dataset with __len__ and __getitem__"
        )
    if len(dataset) == 0:
        raise ParameterError("make_private: the data loader's dataset is empty")
    if data_loader.batch_sampler is None:
        raise ParameterError(
            "make_private: the data loader does not batch (batch_size=None); give it the expected batch size, "
            "DataLoader(dataset, batch_size=B): Poisson batches are drawn at rate B / len(dataset)"
        )


def make_private(
    *,
    module: nn.Module,
    optimizer: Optimizer,
    data_loader: DataLoader,
    max_grad_norm: float,
    noise_multiplier: float | None = None,
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    aug_mult: int = 1,
    accountant: str = DEFAULT_ACCOUNTANT,
    loss_reduction: str = "mean",
    criterion: Callable[..., torch.Tensor] | None = None,
    grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE,
    poisson_sampling: bool = ACCEPTED["poisson_sampling"],
    clipping: str = ACCEPTED["clipping"],
    batch_first: bool = ACCEPTED["batch_first"],
    noise_generator: torch.Generator | None = ACCEPTED["noise_generator"],
    wrap_model: bool = ACCEPTED["wrap_model"],
    rand_on_empty: bool = ACCEPTED["rand_on_empty"],
    debug_seed: int | None = None,
    verify: bool = True,
) -> Made:
    """(module, optimizer, data_loader) for DP-SGD; see docs/make-private.md.

    Whatever `verify` says, the first forward probes a copy of the model at the loader's batch size
    (dp_safety.probe_dp_safety: buffers written from the input or by every forward, examples mixed), and every
    training forward is guarded against buffer writes (buffer_guard.py).

    Args:
        module: the network; it is wrapped so that each example's gradient is computed and clipped.
        optimizer: an optimizer over module's parameters (built before or after conversion, not from others).
        data_loader: the training loader; it is replaced by a Poisson-sampling one of the same expected batch.
        max_grad_norm: the per-example clipping norm.
        noise_multiplier: the noise standard deviation over max_grad_norm; or give target_epsilon.
        target_epsilon: the budget sigma is calibrated for (with target_delta and epochs or steps); a step past
            it is refused.
        target_delta: the delta of the guarantee.
        epochs: the run's length for calibration, in passes over the data.
        steps: the run's length for calibration, in optimizer steps (Opacus' total_steps).
        aug_mult: K views per example: the module takes (B, K, ...) and each example's gradient is the mean over
            its views, clipped.
        accountant: "rdp", "prv" or "gdp" (accounting.py).
        loss_reduction: "mean" or "sum", as the loss the optimizer's step follows.
        criterion: Opacus' ghost-clipping criterion, for grad_sample_mode="ghost".
        grad_sample_mode: Opacus' modes, served or refused as opacus_parity.py says; "ghost" runs ghost clipping
            (fp32 only: a bf16 model or autocast forward is refused) and returns (module, optimizer, criterion,
            data_loader), as Opacus.
        poisson_sampling: only True (the accountants assume Poisson sampling).
        clipping: only "flat" (each example's whole gradient); per-layer and adaptive clipping are refused.
        batch_first: only True (book-keeping takes the batch on the first dimension).
        noise_generator: only None: a given generator would make the noise seedable.
        wrap_model: only True (the returned module records each layer's input).
        rand_on_empty: only False (an empty Poisson batch keeps its shape and the step still runs).
        debug_seed: reproducible sampling and noise for tests (secure_rng.py); the run is then NOT private.
        verify: check once (first training forward) that book-keeping's gradients are exact on this model.

    Returns:
        (module, optimizer, data_loader), or (module, optimizer, criterion, data_loader) for
        grad_sample_mode="ghost".

    Raises:
        OpacusArgumentError: an Opacus argument with a value equiconvert refuses, with the reason and what to do.
        ParameterError: an argument out of range, or noise_multiplier and target_epsilon both or neither given.
    """
    check_opacus_arguments(
        {
            "max_grad_norm": max_grad_norm,
            "grad_sample_mode": grad_sample_mode,
            "poisson_sampling": poisson_sampling,
            "clipping": clipping,
            "batch_first": batch_first,
            "noise_generator": noise_generator,
            "wrap_model": wrap_model,
            "rand_on_empty": rand_on_empty,
        }
    )
    _check_accountant(accountant)
    if accountant in APPROXIMATE_ACCOUNTANT_FACTORIES:
        warnings.warn(GDP_WARNING, UserWarning, stacklevel=2)
    if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ParameterError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm}")
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ParameterError(
            "give noise_multiplier, or target_epsilon (with target_delta and epochs or steps), not both"
        )
    if noise_multiplier is not None and not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ParameterError(f"noise_multiplier must be a finite number > 0 for a private run, got {noise_multiplier}")
    refuse_lightning_module(module)
    _check_loader(data_loader)
    if target_delta is not None:  # before any work: delta >= 1/N is refused, above 1/(10 N) warned about
        refuse_delta(target_delta, len(data_loader.dataset), name="target_delta")
        check_delta_for(target_delta, len(data_loader.dataset))
    planned = _planned_steps(epochs, steps, len(data_loader))
    # the DP-safety check that needs no input (batch statistics, running-statistics buffers, by name); the
    # behavioural probe runs at the module's first forward (private_module.py)
    validate_dp_safe(module)
    check_optimizer_params(module, optimizer, caller="make_private")
    ghost_criterion = (
        DPLoss(nn.CrossEntropyLoss(reduction=loss_reduction) if criterion is None else criterion, loss_reduction)
        if GRAD_SAMPLE_MODES[grad_sample_mode].criterion
        else None
    )
    # before calibration: refuses models its back-end cannot train (by layer, or below fp32 for ghost clipping)
    private = PrivateModule(
        module,
        aug_mult=aug_mult,
        loss_reduction=loss_reduction,
        verify=verify,
        probe_batch=data_loader.batch_size,
        grad_sample_mode=grad_sample_mode,
    )
    if debug_seed is not None:
        warn_not_private("debug_seed")

    loader = DPDataLoader(data_loader, make_source(SAMPLING, debug_seed))
    budget = None
    if target_epsilon is not None:
        if target_delta is None or planned is None:
            raise ParameterError("target_epsilon needs target_delta and epochs or steps (to calibrate the noise)")
        noise_multiplier = calibrate_noise_multiplier(
            target_epsilon, target_delta, loader.sample_rate, planned, accountant
        )
        budget = PrivacyLedger(accountant, target_delta, target_epsilon, loader.sample_rate, noise_multiplier)
    device = next(module.parameters()).device
    dp_optimizer = DPOptimizer(
        optimizer,
        module=private,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=loader.expected_batch_size,
        noise=make_source(NOISE, debug_seed, device),
        accountant=accountant,
        sample_rate=loader.sample_rate,
        budget=budget,
        planned_steps=planned,
        batches_drawn=lambda: loader.batches_drawn,
    )
    if ghost_criterion is not None:
        return private, dp_optimizer, ghost_criterion, loader
    return private, dp_optimizer, loader


class PrivacyEngine:
    """Opacus' PrivacyEngine interface over make_private: `from equiconvert.privacy import PrivacyEngine`.

    `accountant` is an Opacus accountant object (`privacy_engine.accountant.get_epsilon(delta)`), recording every
    step of every optimizer this engine made, as Opacus'. Sampling and noise randomness is always secret
    (secure_rng.py), whatever `secure_mode` says.
    """

    def __init__(self, *, accountant: str = DEFAULT_ACCOUNTANT, secure_mode: bool = True) -> None:
        _check_accountant(accountant)
        self.accountant = make_accountant(accountant)
        self.secure_mode = secure_mode

    def _record_step(self, optimizer: DPOptimizer) -> None:
        self.accountant.step(noise_multiplier=optimizer.noise_multiplier, sample_rate=optimizer.sample_rate)

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float,
        **options: Any,
    ) -> Made:
        """make_private at a given noise multiplier (options: make_private's keywords, Opacus' included)."""
        check_opacus_arguments(options)  # the keywords Opacus forwards to its optimizer or calibration
        made = make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            accountant=self.accountant.mechanism(),
            **options,
        )
        made[1].attach_step_hook(self._record_step)
        return made

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        max_grad_norm: float,
        epochs: float | None = None,
        total_steps: int | None = None,
        **options: Any,
    ) -> Made:
        """make_private with the noise calibrated to (target_epsilon, target_delta) after `epochs` (or
        `total_steps`) and a step past the target refused."""
        check_opacus_arguments(options)  # the keywords Opacus forwards to its optimizer or calibration
        if len(self.accountant) > 0:
            warnings.warn(
                "make_private_with_epsilon on an engine that has already recorded steps: the noise is calibrated "
                "from zero, so the engine's total epsilon will exceed target_epsilon",
                UserWarning,
                stacklevel=2,
            )
        made = make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            epochs=epochs,
            steps=total_steps,
            max_grad_norm=max_grad_norm,
            accountant=self.accountant.mechanism(),
            **options,
        )
        made[1].attach_step_hook(self._record_step)
        return made

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at `delta` by every step this engine's optimizers took (0.0 before the first)."""
        return accountant_epsilon(self.accountant, delta)

    def validate(self, *, module: nn.Module, optimizer: Optimizer | None = None, data_loader: Any = None) -> None:
        """Raise PrivacyValidationError, naming the layer, for a module DP-SGD cannot train (by layer names)."""
        validate_dp_safe(module)

    def is_compatible(self, *, module: nn.Module, optimizer: Optimizer | None = None, data_loader: Any = None) -> bool:
        """Whether `validate` passes."""
        try:
            validate_dp_safe(module)
        except PrivacyValidationError:
            return False
        return True

    @classmethod
    def get_compatible_module(cls, module: nn.Module) -> nn.Module:
        """Opacus' ModuleValidator fixes (batch norm to group norm, ...), then `validate`."""
        fixed = ModuleValidator.fix(module)
        validate_dp_safe(fixed)
        return fixed

    def save_checkpoint(self, *, path: Any, module: nn.Module, optimizer: DPOptimizer | None = None, **options: Any):
        """Opacus' save_checkpoint: module, optimizer and accountant states; never the secret noise or sampling
        generators (engine_checkpoint.py)."""
        save_engine_checkpoint(self.accountant, path, module, optimizer, **options)

    def load_checkpoint(
        self, *, path: Any, module: nn.Module, optimizer: DPOptimizer | None = None, **options: Any
    ) -> dict[str, Any]:
        """Opacus' load_checkpoint, read with torch.load(weights_only=True), into an engine that has recorded no
        step yet; returns the rest of the checkpoint (engine_checkpoint.py)."""
        return load_engine_checkpoint(self.accountant, path, module, optimizer, **options)
