"""PrivacyEngine.save_checkpoint / load_checkpoint, in Opacus' file layout, without Opacus' risks.

The file holds the module's state, the accountant's history, the wrapped optimizer's state and the step count
(and, for make_private_with_epsilon, the budget ledger): never the noise or sampling generators, whose states are
secret (secure_rng.py; whoever holds them can subtract the noise). It is read with torch.load(weights_only=True)
(a crafted file cannot run code) and every accountant entry is checked. Loading replaces the engine's accountant
history, so it is refused once the engine has recorded steps: those would be dropped and epsilon under-reported.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from opacus.accountants import IAccountant
from torch import nn

from ..errors import ParameterTypeError, UnreadableFileError
from ..untrusted_file import load_weights_only
from .accounting import load_accountant_state
from .checkpoint import CheckpointError, save_atomic
from .dp_optimizer import DPOptimizer
from .opacus_parity import OpacusArgumentError, check_opacus_arguments

MODULE = "module_state_dict"  # Opacus' keys
ACCOUNTANT = "privacy_accountant_state_dict"
OPTIMIZER = "optimizer_state_dict"
STEPS = "dp_optimizer_steps"  # equiconvert's: the optimizer's step count and budget ledger
BUDGET = "privacy_budget_state_dict"
SAVE_OPTIONS = ("checkpoint_dict", "module_state_dict_kwargs", "torch_save_kwargs")  # Opacus' keywords
LOAD_OPTIONS = ("module_load_dict_kwargs", "torch_load_kwargs")
_SCHEDULERS = ("noise_scheduler", "grad_clip_scheduler")  # refused unless None (opacus_parity.py)


def _check_options(options: dict[str, Any], known: tuple[str, ...]) -> None:
    unknown = set(options) - set(known) - set(_SCHEDULERS)
    if unknown:
        raise ParameterTypeError(f"unexpected keyword argument(s) {sorted(unknown)}; Opacus' are {known + _SCHEDULERS}")
    check_opacus_arguments({name: options[name] for name in _SCHEDULERS if name in options})


def save_engine_checkpoint(
    accountant: IAccountant,
    path: str | os.PathLike | Any,
    module: nn.Module,
    optimizer: DPOptimizer | None,
    **options: Any,
) -> None:
    """Write the checkpoint; to a path: atomically and owner-only (checkpoint.save_atomic)."""
    _check_options(options, SAVE_OPTIONS)
    state = dict(options.get("checkpoint_dict") or {})
    state[MODULE] = module.state_dict(**(options.get("module_state_dict_kwargs") or {}))
    state[ACCOUNTANT] = accountant.state_dict()
    if optimizer is not None:
        state[OPTIMIZER] = optimizer.state_dict()  # the wrapped optimizer's: no generator in it
        state[STEPS] = optimizer.steps
        if optimizer.budget is not None:
            state[BUDGET] = optimizer.budget.state_dict()
    save_kwargs = options.get("torch_save_kwargs") or {}
    if isinstance(path, (str, os.PathLike)) and not save_kwargs:
        save_atomic(state, path)
    else:
        torch.save(state, path, **save_kwargs)


def load_engine_checkpoint(
    accountant: IAccountant,
    path: str | os.PathLike | Any,
    module: nn.Module,
    optimizer: DPOptimizer | None,
    **options: Any,
) -> dict[str, Any]:
    """Restore module, accountant and optimizer; returns the checkpoint less the optimizer's entries (as Opacus)."""
    _check_options(options, LOAD_OPTIONS)
    load_kwargs = options.get("torch_load_kwargs") or {}
    if "weights_only" in load_kwargs:
        raise OpacusArgumentError(
            "torch_load_kwargs: weights_only is always True here (a checkpoint file cannot run code); leave it out"
        )
    if len(accountant) > 0:
        raise OpacusArgumentError(
            "load_checkpoint replaces the engine's accountant history, and this engine has already recorded steps "
            "that would be dropped (epsilon under-reported): load the checkpoint into a new PrivacyEngine before "
            "training"
        )
    try:
        state = load_weights_only(path, **load_kwargs)
    except UnreadableFileError as error:
        raise CheckpointError(
            f"{path}: corrupt or not a PrivacyEngine checkpoint (it is read with weights_only=True and never "
            "unpickled unsafely); save it again with PrivacyEngine.save_checkpoint"
        ) from error.__cause__
    if not isinstance(state, dict) or MODULE not in state or ACCOUNTANT not in state:
        raise CheckpointError(f"{path} is not a PrivacyEngine checkpoint (no {MODULE!r} and {ACCOUNTANT!r})")
    if optimizer is not None and optimizer.budget is not None and BUDGET not in state:  # before changing anything
        raise CheckpointError(
            f"{path} has no privacy budget state, and this optimizer enforces target_epsilon: its steps "
            "would be uncounted against the budget; resume with make_private(noise_multiplier=...) instead"
        )
    if STEPS in state and (type(state[STEPS]) is not int or state[STEPS] < 0):
        raise CheckpointError(f"{path}: {STEPS} must be an integer >= 0, got {state[STEPS]!r}")
    module.load_state_dict(state[MODULE], **(options.get("module_load_dict_kwargs") or {}))
    load_accountant_state(accountant, state[ACCOUNTANT])
    optimizer_state = state.pop(OPTIMIZER, {})
    steps = state.pop(STEPS, None)
    budget = state.pop(BUDGET, None)
    if optimizer is None or not optimizer_state:
        if optimizer is not None or optimizer_state:
            warnings.warn(
                f"the checkpoint's optimizer state has {len(optimizer_state)} entries but an optimizer was "
                f"{'' if optimizer is not None else 'not '}given: it is not restored",
                UserWarning,
                stacklevel=3,
            )
        return state
    optimizer.load_state_dict(optimizer_state)
    if steps is not None:
        optimizer.steps = steps
    if optimizer.budget is not None:
        optimizer.budget.load_state_dict(budget)
    return state
