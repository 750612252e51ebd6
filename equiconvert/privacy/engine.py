"""Opacus-style `make_private`: the user's model, optimizer and DataLoader, made DP-SGD by book-keeping.

    model, optimizer, train_loader = make_private(module=model, optimizer=optimizer, data_loader=train_loader,
                                                  noise_multiplier=1.0, max_grad_norm=1.0)

or `PrivacyEngine().make_private(...)` with Opacus' signature, so that an Opacus script
changes only its import. The loop stays the user's: forward, `loss.backward()`,
`optimizer.step()`. Per-example gradients come from book-keeping (private_module.py)
instead of Opacus' hooks; the step from dp_optimizer.py (its clipping and noise: dp_step.py); Poisson
batches from dp_loader.py; epsilon from Opacus' accountants (accounting.py).
"""

from __future__ import annotations

import math

from typing import Any

from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from ..errors import ParameterError
from .accounting import ACCOUNTANTS, PrivacyLedger, calibrate_noise_multiplier, check_delta_for, refuse_delta
from .dp_loader import DPDataLoader
from .dp_optimizer import DPOptimizer
from .private_module import PrivateModule
from .secure_rng import NOISE, SAMPLING, make_source, warn_not_private
from .validate import validate_dp_safe

DEFAULT_ACCOUNTANT = "prv"  # Opacus' PrivacyEngine default: a swapped import reports the same epsilon


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


def _check_optimizer_params(module: nn.Module, optimizer: Optimizer) -> None:
    """Every trainable parameter the optimizer updates must be the module's, or its update would not be private."""
    owned = {id(p) for p in module.parameters()}
    foreign = [
        tuple(p.shape)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.requires_grad and id(p) not in owned
    ]
    if foreign:
        raise ParameterError(
            f"the optimizer updates {len(foreign)} parameter(s) that are not the module's (shapes "
            f"{foreign[:5]}); their gradients would not be clipped or noised: build the optimizer "
            "from module.parameters()"
        )


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
    poisson_sampling: bool = True,
    debug_seed: int | None = None,
    verify: bool = True,
) -> tuple[PrivateModule, DPOptimizer, DPDataLoader]:
    """(module, optimizer, data_loader) for DP-SGD; see docs/make-private.md.

    noise_multiplier, or target_epsilon with target_delta and epochs or steps (sigma is then
    calibrated and a step past the target is refused). aug_mult K: the module takes
    (B, K, ...) views and each example's gradient is the mean over its views, clipped.
    debug_seed: reproducible sampling and noise for tests (secure_rng.py); the run is then NOT private.
    verify: check once (first training forward) that book-keeping's gradients are exact on this model
    (bookkeeping.verify_bookkeeping). Whatever it says, the first forward probes a copy of the model at the
    loader's batch size (dp_safety.probe_dp_safety: buffers written from the input or by every forward, examples
    mixed), and every training forward is guarded against buffer writes (buffer_guard.py).
    """
    if accountant not in ACCOUNTANTS:
        raise ParameterError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    if not poisson_sampling:
        raise ParameterError("make_private samples batches by Poisson sampling only: the accountants assume it")
    if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ParameterError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm}")
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ParameterError(
            "give noise_multiplier, or target_epsilon (with target_delta and epochs or steps), not both"
        )
    if noise_multiplier is not None and not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ParameterError(f"noise_multiplier must be a finite number > 0 for a private run, got {noise_multiplier}")
    _check_loader(data_loader)
    if target_delta is not None:  # before any work: delta >= 1/N is refused, above 1/(10 N) warned about
        refuse_delta(target_delta, len(data_loader.dataset), name="target_delta")
        check_delta_for(target_delta, len(data_loader.dataset))
    planned = _planned_steps(epochs, steps, len(data_loader))
    # the DP-safety check that needs no input (batch statistics, running-statistics buffers, by name); the
    # behavioural probe runs at the module's first forward (private_module.py)
    validate_dp_safe(module)
    _check_optimizer_params(module, optimizer)
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
    private = PrivateModule(
        module, aug_mult=aug_mult, loss_reduction=loss_reduction, verify=verify, probe_batch=data_loader.batch_size
    )
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
    )
    return private, dp_optimizer, loader


class PrivacyEngine:
    """Opacus' PrivacyEngine interface over make_private: `from equiconvert.privacy import PrivacyEngine`.

    Sampling and noise randomness is always secret (secure_rng.py), whatever `secure_mode` says.
    """

    def __init__(self, *, accountant: str = DEFAULT_ACCOUNTANT, secure_mode: bool = True) -> None:
        if accountant not in ACCOUNTANTS:
            raise ParameterError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
        self.accountant = accountant
        self.secure_mode = secure_mode
        self._optimizers: list[DPOptimizer] = []

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float,
        **options: Any,
    ) -> tuple[PrivateModule, DPOptimizer, DPDataLoader]:
        """make_private at a given noise multiplier (options: make_private's keywords)."""
        made = make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            accountant=self.accountant,
            **options,
        )
        self._optimizers.append(made[1])
        return made

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        epochs: float,
        max_grad_norm: float,
        **options: Any,
    ) -> tuple[PrivateModule, DPOptimizer, DPDataLoader]:
        """make_private with the noise calibrated to (target_epsilon, target_delta) after `epochs`."""
        made = make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            epochs=epochs,
            max_grad_norm=max_grad_norm,
            accountant=self.accountant,
            **options,
        )
        self._optimizers.append(made[1])
        return made

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent so far at `delta` (one model made private per engine)."""
        if len(self._optimizers) > 1:
            raise ParameterError(
                "this engine made several models private; ask each optimizer: optimizer.get_epsilon(delta)"
            )
        return self._optimizers[0].get_epsilon(delta) if self._optimizers else 0.0
