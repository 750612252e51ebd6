"""The optimizer make_private returns: clip per example, sum, add noise once per logical batch, step.

`step()` takes the clipped sum of the last forward/backward from the PrivateModule
(each example's whole gradient clipped to `max_grad_norm`, by its back-end: book-keeping
or ghost clipping) and adds it to an accumulator; an example whose gradient has a NaN or inf entry
counts as zero, so one bad input cannot make the step NaN (dp_step.py, as DPTrainer). Unless
BatchMemoryManager signalled that more physical batches of the same logical batch
follow, it then adds N(0, (sigma C)^2) to each trainable parameter's sum once,
divides by the expected batch size (loss_reduction "mean"), writes the result to
`.grad` and steps the wrapped optimizer. Parameters that do not require gradients keep
`.grad` None, so the wrapped optimizer leaves them alone.

Opacus' DPOptimizer surface: `pre_step()` does all of the above but the wrapped optimizer's step
and says whether to take it; `grad_samples` are the last backward's per-example gradients,
`accumulated_iterations` how many backwards wait for a step (0 or 1 here), `params` the
parameters; what is refused says why (opacus_parity.REFUSED_OPTIMIZER_ATTRIBUTES).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any, NoReturn, SupportsIndex

import torch
from torch import nn
from torch.optim import Optimizer

from ..errors import ParameterError, UsageError
from .accounting import PrivacyBudgetError, PrivacyLedger, compute_epsilon
from .dp_step import privatize
from .lightning_guard import refuse_undrawn_batch
from .opacus_parity import GHOST_GRAD_SAMPLES, REFUSED_OPTIMIZER_ATTRIBUTES, refuse_attribute
from .private_module import PrivateModule
from .secure_rng import RandomSource


class OptimizerCopyError(UsageError, TypeError):
    """A DPOptimizer given to copy.copy, copy.deepcopy or pickle."""


class DPOptimizer(Optimizer):
    """Wraps `optimizer` (kept as `original_optimizer`); param_groups, state and defaults are its own."""

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        module: PrivateModule,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        noise: RandomSource,
        accountant: str,
        sample_rate: float,
        budget: PrivacyLedger | None = None,
        planned_steps: int | None = None,
        batches_drawn: Callable[[], int] | None = None,
    ) -> None:
        """batches_drawn: how many batches the Poisson loader has drawn; a step given a closure (a training
        framework's loop, as Lightning's) is refused unless that loader drew its batch."""
        self.original_optimizer = optimizer
        self.module = module
        self.noise_multiplier = float(noise_multiplier)
        self.max_grad_norm = float(max_grad_norm)
        self.expected_batch_size = float(expected_batch_size)
        self.accountant = accountant
        self.sample_rate = float(sample_rate)
        self.budget = budget  # with a target epsilon: the ledger that stops a step past it
        self.planned_steps = planned_steps
        self._noise = noise
        self.private = noise.private  # False under debug_seed: reproducible noise is not private
        self._skip_next = False
        self._summed: dict[nn.Parameter, torch.Tensor] = {}
        self._examples = 0
        device = optimizer.param_groups[0]["params"][0].device
        self._nonfinite = torch.zeros((), dtype=torch.int64, device=device)  # examples zeroed (nonfinite.py)
        self.steps = 0
        self._step_hooks: list[Callable[[DPOptimizer], None]] = []
        self._batches_drawn = batches_drawn
        self._closure_steps = 0  # steps given a closure by this optimizer (not restored from checkpoints)

    # --- the wrapped optimizer's state --------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = groups

    @property
    def state(self) -> defaultdict:  # type: ignore[override]
        return self.original_optimizer.state

    @state.setter
    def state(self, state: defaultdict) -> None:
        self.original_optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.original_optimizer.defaults = defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.original_optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        """copy.copy, copy.deepcopy and pickle are refused: a copy would hold the secret noise generator's state."""
        raise OptimizerCopyError(
            "the optimizer make_private returned cannot be copied or pickled: a copy would draw the same secret "
            "noise as the original (whoever held both could subtract it) and take steps the accounting never sees; "
            "save optimizer.state_dict() (or PrivacyEngine.save_checkpoint) and call make_private again instead"
        )

    def __repr__(self) -> str:
        return (
            f"DPOptimizer({self.original_optimizer!r}, noise_multiplier={self.noise_multiplier}, "
            f"max_grad_norm={self.max_grad_norm})"
        )

    def __getattr__(self, name: str) -> Any:
        """Called only for a name the optimizer lacks: Opacus' names equiconvert refuses say why."""
        raise refuse_attribute(type(self).__name__, name, REFUSED_OPTIMIZER_ATTRIBUTES)

    # --- Opacus' DPOptimizer surface -----------------------------------------------------------------
    @property
    def params(self) -> list[nn.Parameter]:
        """Every parameter the wrapped optimizer holds, in its order (Opacus' `params`)."""
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def loss_reduction(self) -> str:
        return self.module.loss_reduction

    @property
    def grad_samples(self) -> list[torch.Tensor]:
        """Each trainable parameter's per-example gradients (B, *shape) from the last backward, in `params` order."""
        if self.module.method == "ghost":  # a ValueError, as Opacus' (an AttributeError would read as a miss)
            raise ParameterError(f"optimizer.grad_samples is not supported: {GHOST_GRAD_SAMPLES}")
        self.module.require_hooks()
        grads = self.module.per_sample_gradients()
        return [grads[p] for p in self.params if p.requires_grad]

    @property
    def accumulated_iterations(self) -> int:
        """Backwards recorded and not yet taken into a step: 1 after a training backward, else 0 (one per step)."""
        return 1 if self.module.pending_backward else 0

    def clip_and_accumulate(self) -> None:
        """Clip the last backward's per-example gradients and add them to this logical batch's sum (no noise)."""
        self.module.require_hooks()
        self._accumulate()

    @property
    def nonfinite_gradients(self) -> int:
        """Examples whose gradient had a NaN or inf entry and counted as zero so far (waits for the device).

        A noise-free statistic of the training data: the optimizer never prints or logs it.
        """
        return int(self._nonfinite)

    # --- DP-SGD --------------------------------------------------------------------------------
    def signal_skip_step(self, do_skip: bool = True) -> None:
        """The next step() only accumulates: more physical batches of this logical batch follow."""
        self._skip_next = do_skip

    def attach_step_hook(self, fn: Callable[[DPOptimizer], None]) -> None:
        """Call `fn(self)` at each noisy step, once `.grad` is written and before the wrapped optimizer steps (as
        Opacus' hooks; PrivacyEngine's accountant records steps so)."""
        self._step_hooks.append(fn)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the last backward's gradients (as Opacus drops grad_sample); a logical batch's clipped sum is kept."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self.module.clear_record()

    def _trainable(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _accumulate(self) -> None:
        """Add the last physical batch's clipped per-example gradients to the running sum."""
        examples = self.module.recorded_examples
        if examples:
            self._nonfinite += self.module.accumulate_clipped(self.max_grad_norm, self._summed)
            self._examples += examples
        self.module.clear_record()

    def _check_budget(self) -> None:
        """Refuse a step past the target epsilon (asked only once the planned steps are spent: PRV is slow)."""
        if self.budget is None or (self.planned_steps is not None and self.steps < self.planned_steps):
            return
        if not self.budget.can_step():
            raise PrivacyBudgetError(
                f"one more step would exceed target_epsilon={self.budget.target_epsilon} (after "
                f"{self.steps} steps, epsilon {self.budget.epsilon:.4f}); make_private was "
                f"calibrated for {self.planned_steps} steps"
            )

    def pre_step(self, closure: Callable[[], float] | None = None) -> bool:
        """Opacus' pre_step: clip and add the last backward's examples; after a logical batch's last one, add the
        noise once, write `.grad` and account the step. True when the wrapped optimizer should now step."""
        if closure is not None:
            self._run_closure(closure)
        self.module.require_hooks()
        self._accumulate()
        if self._skip_next:
            self._skip_next = False
            return False
        self._check_budget()
        divisor = self.expected_batch_size if self.module.loss_reduction == "mean" else 1.0
        summed = {p: self._summed[p] if p in self._summed else torch.zeros_like(p) for p in self._trainable()}
        noisy = privatize(summed, self.noise_multiplier, self.max_grad_norm, self._noise, divisor)
        for param, grad in noisy.items():
            param.grad = grad
        if self.budget is not None:
            self.budget.step()
        self.steps += 1
        self._summed, self._examples = {}, 0
        for hook in self._step_hooks:
            hook(self)
        return True

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None if closure is None else self._run_closure(closure)
        if self.pre_step():
            self.original_optimizer.step()
        return loss

    def _run_closure(self, closure: Callable[[], float]) -> float:
        """A training framework's step (Lightning's): refused unless the Poisson loader drew this batch."""
        if not self._skip_next and self._batches_drawn is not None:
            refuse_undrawn_batch(self._batches_drawn(), self._closure_steps)
            self._closure_steps += 1
        with torch.enable_grad():
            return closure()

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent by the steps taken so far, at `delta`, by this run's accountant."""
        return compute_epsilon(self.accountant, self.noise_multiplier, self.sample_rate, self.steps, delta)
