"""Privacy accounting of DP-SGD, delegated entirely to Opacus' accountants.

Nothing here re-derives RDP or PRV bounds: every epsilon comes from an Opacus
accountant's `get_epsilon` on a history of (noise_multiplier, sample_rate,
steps) entries. This module only adds argument checks, verification of the
calibrated noise, a wider range of RDP orders, and a ledger that stops training
*before* the budget is spent.
"""

from __future__ import annotations

import contextlib
import copy
import math
import operator
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Callable

from opacus.accountants import GaussianAccountant, IAccountant, PRVAccountant, RDPAccountant
from opacus.accountants.utils import get_noise_multiplier

from ..errors import ParameterError, ParameterTypeError, PrivacyError
from .accountant_names import ACCOUNTANTS, PRV, RDP

History = tuple[tuple[float, float, int], ...]

_MAX_SIGMA = 1e6  # the same ceiling Opacus' get_noise_multiplier gives up at
_MAX_SEARCH_STEPS = 2**40  # max_steps() gives up (raises) beyond this many steps
_MAX_REFINEMENTS = 100  # bracketing / bisection rounds in calibrate_noise_multiplier
_CACHE_SIZE = 4096
_OPACUS_ORDER_WARNING = "Optimal order is the (largest|smallest) alpha"
_OPACUS_GDP_WARNING = "GDP accounting is experimental"
# warnings.catch_warnings swaps process-global state: two threads interleaving it can leave a filter behind.
_WARNINGS_LOCK = threading.RLock()


class LooseBoundWarning(UserWarning):
    """An RDP epsilon whose best order is the first or last one evaluated: a tighter bound exists."""


@contextlib.contextmanager
def _opacus_order_warning_silenced() -> Iterator[None]:
    """Opacus' "optimal order is the largest/smallest alpha" warning off: it fires at every one of the many epsilons
    a calibration or a step search computes; the reported epsilon gets one LooseBoundWarning of ours instead.
    Likewise the GDP accountant's warning, which fires at every accountant made."""
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_OPACUS_ORDER_WARNING)
        warnings.filterwarnings("ignore", message=_OPACUS_GDP_WARNING)  # engine.py warns once per run instead
        yield


class WideRangeRDPAccountant(RDPAccountant):
    """Opacus' RDP accountant, minimising over orders up to 512 instead of 63.

    With orders up to 63, epsilon can never drop below 0.103 at delta=1e-5
    however much noise is added, and small budgets get a loose bound. More
    orders only tighten the minimum (each order is a valid bound); 512 keeps
    Opacus' binomial sums (scipy.special.binom) finite.
    """

    DEFAULT_ALPHAS = RDPAccountant.DEFAULT_ALPHAS + [80, 96, 128, 160, 192, 256, 320, 384, 512]


# the accountants by name (accountant_names.ACCOUNTANTS: DPConfig.accountant, --accountant)
ACCOUNTANT_FACTORIES: dict[str, Callable[[], IAccountant]] = {RDP: WideRangeRDPAccountant, PRV: PRVAccountant}
# Opacus' GDP accountant, a central-limit approximation that can underestimate epsilon: accepted only by the
# Opacus-style front-end (engine.py, which warns), so that a script asking for it runs
APPROXIMATE_ACCOUNTANT_FACTORIES: dict[str, Callable[[], IAccountant]] = {"gdp": GaussianAccountant}
_ANY_FACTORY = {**ACCOUNTANT_FACTORIES, **APPROXIMATE_ACCOUNTANT_FACTORIES}


class PrivacyBudgetError(PrivacyError, ValueError):
    """A privacy target cannot be met (or has already been exceeded)."""


def _check_kind(kind: str) -> None:
    if kind not in _ANY_FACTORY:
        raise ParameterError(f"unknown accountant {kind!r}; choose one of {ACCOUNTANTS}")


def make_accountant(kind: str) -> IAccountant:
    """A fresh Opacus accountant of `kind` (a name in ACCOUNTANT_FACTORIES or APPROXIMATE_ACCOUNTANT_FACTORIES)."""
    _check_kind(kind)
    with _opacus_order_warning_silenced():
        return _ANY_FACTORY[kind]()


def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ParameterError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ParameterError(f"delta must lie in (0, 1), got {delta!r}")
    return delta


def _check_sample_rate(sample_rate: float) -> float:
    sample_rate = float(sample_rate)
    if not 0.0 < sample_rate <= 1.0:
        raise ParameterError(f"sample_rate must lie in (0, 1], got {sample_rate!r}")
    return sample_rate


def _check_steps(steps: int, minimum: int = 0) -> int:
    if isinstance(steps, bool):
        raise ParameterTypeError("steps must be an integer, got a bool")
    steps = operator.index(steps)  # rejects 2.5, accepts numpy integers
    if steps < minimum:
        raise ParameterError(f"steps must be >= {minimum}, got {steps}")
    return steps


def _epsilon_of_history(kind: str, history: History, delta: float) -> float:
    """Opacus' epsilon for `history`; 0.0 for an empty one (nothing released yet).

    PRV runs with Opacus' default eps_error, the same one get_noise_multiplier
    uses, so calibration and reporting agree.
    """
    if not history:
        return 0.0
    accountant = make_accountant(kind)
    accountant.history = [tuple(entry) for entry in history]
    # (Opacus' PRV sizes its discretisation domain with an RDP bound at a tiny delta: its order warning concerns
    # that domain only, not the epsilon returned.)
    with _opacus_order_warning_silenced():
        epsilon = float(accountant.get_epsilon(delta=delta))
    # Opacus' RDP conversion goes slightly negative for large delta at high orders (about -6e-4 at
    # delta=1e-3); raising a bound to 0 keeps it valid and a reported epsilon meaningful.
    return max(epsilon, 0.0)


def warn_if_loose(kind: str, history: History, delta: float) -> bool:
    """One LooseBoundWarning when RDP's best order for `history` is the first or last of its orders; whether so."""
    if kind != "rdp" or not history:
        return False
    accountant = make_accountant(kind)
    accountant.history = [tuple(entry) for entry in history]
    with _opacus_order_warning_silenced():
        epsilon, order = accountant.get_privacy_spent(delta=delta)
    orders = WideRangeRDPAccountant.DEFAULT_ALPHAS
    if order not in (orders[0], orders[-1]):
        return False
    end = "largest" if order == orders[-1] else "smallest"
    warnings.warn(
        f"RDP's epsilon {epsilon:.4g} at delta {delta:g} is tightest at its {end} order ({order:g}): the bound is "
        "loose there; accountant='prv' gives a tighter epsilon",
        LooseBoundWarning,
        stacklevel=3,
    )
    return True


def compute_epsilon(kind: str, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """Epsilon after `steps` identical DP-SGD steps, as the Opacus accountant `kind` reports it (with a
    LooseBoundWarning where RDP's best order is an end of its orders)."""
    _check_kind(kind)
    history = (
        (_check_positive("noise_multiplier", noise_multiplier), _check_sample_rate(sample_rate), _check_steps(steps)),
    )
    if history[0][2] == 0:
        return 0.0
    epsilon = _epsilon_of_history(kind, history, _check_delta(delta))
    warn_if_loose(kind, history, delta)
    return epsilon


def accountant_epsilon(accountant: IAccountant, delta: float) -> float:
    """Epsilon of an Opacus accountant's history at `delta`, as compute_epsilon reports it (0.0 before any step;
    RDP over this module's wider range of orders, with a LooseBoundWarning where its best order is an end)."""
    kind = accountant.mechanism()
    history = tuple(tuple(entry) for entry in accountant.history)
    epsilon = _epsilon_of_history(kind, history, _check_delta(delta))
    warn_if_loose(kind, history, delta)
    return epsilon


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    kind: str,
    tolerance: float = 0.01,
) -> float:
    """Noise multiplier whose epsilon after `steps` lies in [target - tolerance, target].

    Opacus' get_noise_multiplier proposes sigma; we re-check it with
    compute_epsilon and refine by bisection if it is above the target by any
    amount (a budget overrun is a privacy bug) or more than `tolerance` below
    it (wasted utility). Raises PrivacyBudgetError if the target is unreachable.
    """
    _check_kind(kind)
    target_epsilon = _check_positive("target_epsilon", target_epsilon)
    tolerance = _check_positive("tolerance", tolerance)
    delta = _check_delta(delta)
    sample_rate = _check_sample_rate(sample_rate)
    steps = _check_steps(steps, minimum=1)

    def eps(sigma: float) -> float:  # a candidate's epsilon: no warning (the ledger warns about the one chosen)
        return _epsilon_of_history(kind, ((sigma, sample_rate, steps),), delta)

    def unreachable() -> PrivacyBudgetError:
        floor = ""
        if kind == "rdp":
            with _opacus_order_warning_silenced():
                smallest = eps(_MAX_SIGMA)
            floor = f" (the smallest epsilon RDP certifies here is {smallest:.4f}; the PRV accountant goes lower)"
        return PrivacyBudgetError(
            f"epsilon={target_epsilon} at delta={delta} is unreachable with {steps} steps at sample rate "
            f"{sample_rate} ({kind} accountant), even with noise multiplier {_MAX_SIGMA:g}{floor}; "
            "raise the target, or lower the number of steps or the sample rate"
        )

    orders = {"alphas": WideRangeRDPAccountant.DEFAULT_ALPHAS} if kind == "rdp" else {}
    # Candidates far above the answer have their optimum at the largest order; only the final
    # sigma's epsilon, computed again by the caller's ledger, should warn about that.
    with _opacus_order_warning_silenced():
        try:
            sigma = float(
                get_noise_multiplier(
                    target_epsilon=target_epsilon,
                    target_delta=delta,
                    sample_rate=sample_rate,
                    steps=steps,
                    accountant=kind,
                    epsilon_tolerance=tolerance,
                    **orders,
                )
            )
        except ValueError as error:  # Opacus: "The privacy budget is too low." (it stops doubling past 1e6)
            if eps(_MAX_SIGMA) > target_epsilon:
                raise unreachable() from error
            sigma = _MAX_SIGMA  # reachable at the ceiling itself: bisect down from there

    # Bracket: eps(lo) > target >= eps(hi); then bisect until eps(hi) is within tolerance.
    eps_sigma = eps(sigma)
    if eps_sigma <= target_epsilon:
        hi, eps_hi, lo = sigma, eps_sigma, sigma
        factor = 1e-3
        for _ in range(_MAX_REFINEMENTS):  # too much noise: find less
            if target_epsilon - eps_hi <= tolerance:
                break
            lo = hi * (1.0 - factor)
            eps_lo = eps(lo)
            if eps_lo > target_epsilon:
                break
            hi, eps_hi = lo, eps_lo
            factor = min(2 * factor, 0.5)
    else:
        lo, hi, factor = sigma, sigma, 1e-3
        for _ in range(_MAX_REFINEMENTS):  # too little noise: find more
            hi = lo * (1.0 + factor)
            if hi > _MAX_SIGMA:
                raise unreachable()
            eps_hi = eps(hi)
            if eps_hi <= target_epsilon:
                break
            lo, factor = hi, 2 * factor
        else:
            raise unreachable()
    for _ in range(_MAX_REFINEMENTS):
        if target_epsilon - eps_hi <= tolerance:
            break
        mid = 0.5 * (lo + hi)
        eps_mid = eps(mid)
        if eps_mid <= target_epsilon:
            hi, eps_hi = mid, eps_mid
        else:
            lo = mid
    if not (eps_hi <= target_epsilon and target_epsilon - eps_hi <= tolerance):
        raise PrivacyBudgetError(
            f"could not calibrate sigma to epsilon in [{target_epsilon - tolerance}, {target_epsilon}] "
            f"({kind}); best sigma {hi} gives epsilon {eps_hi}; try a larger tolerance"
        )
    return hi


def load_accountant_state(accountant: IAccountant, state: dict[str, Any]) -> None:
    """Restore an Opacus accountant's `state_dict()` read from a file (untrusted): each history entry is checked,
    Opacus checks the mechanism."""
    if not isinstance(state, dict):
        raise ParameterError(f"state: an accountant state is a dict, got {type(state).__name__}")
    state = copy.deepcopy(state)
    for entry in state.get("history", ()):
        sigma, rate, count = entry
        _check_positive("noise_multiplier", sigma)
        _check_sample_rate(rate)
        _check_steps(count, minimum=1)
    accountant.load_state_dict(state)


class PrivacyLedger:
    """A training run's privacy spending, so it can stop before exceeding its budget.

    `step()` records a step that has been (or is being) released, always: an
    unrecorded release would under-report epsilon. The gate is `can_step()`,
    to be asked *before* computing the noisy gradient. Epsilons are cached by
    history, since PRV's get_epsilon takes about a second.
    """

    def __init__(
        self, kind: str, delta: float, target_epsilon: float | None, sample_rate: float, noise_multiplier: float
    ) -> None:
        self.kind = kind
        self._accountant = make_accountant(kind)
        self.delta = _check_delta(delta)
        self.target_epsilon = None if target_epsilon is None else _check_positive("target_epsilon", target_epsilon)
        self.sample_rate = _check_sample_rate(sample_rate)
        self.noise_multiplier = _check_positive("noise_multiplier", noise_multiplier)
        self._epsilons: dict[History, float] = {}
        self._max_steps: dict[History, int] = {}
        self._warned_loose = False

    def _history(self, extra_steps: int = 0) -> History:
        """The accountant's history after `extra_steps` more steps, merged as Opacus' step() merges."""
        history = [tuple(entry) for entry in self._accountant.history]
        if extra_steps:
            if history and history[-1][:2] == (self.noise_multiplier, self.sample_rate):
                history[-1] = (self.noise_multiplier, self.sample_rate, history[-1][2] + extra_steps)
            else:
                history.append((self.noise_multiplier, self.sample_rate, extra_steps))
        return tuple(history)

    def _epsilon(self, history: History) -> float:
        if history not in self._epsilons:
            if len(self._epsilons) >= _CACHE_SIZE:
                self._epsilons.clear()
            self._epsilons[history] = _epsilon_of_history(self.kind, history, self.delta)
        return self._epsilons[history]

    def step(self) -> None:
        """Record one released DP-SGD step at this ledger's noise multiplier and sample rate."""
        self._accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)

    @property
    def steps(self) -> int:
        """Steps recorded so far (including those of a loaded state)."""
        return sum(int(entry[2]) for entry in self._accountant.history)

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far at this ledger's delta; 0.0 before the first step. The first one that RDP bounds
        at an end of its orders gives one LooseBoundWarning."""
        history = self._history()
        if not self._warned_loose:
            self._warned_loose = warn_if_loose(self.kind, history, self.delta)
        return self._epsilon(history)

    def epsilon_after(self, extra_steps: int) -> float:
        """Epsilon after `extra_steps` more steps, without recording them."""
        return self._epsilon(self._history(_check_steps(extra_steps)))

    def can_step(self) -> bool:
        """False when one more step would push epsilon above the target (always True without one)."""
        return self.target_epsilon is None or self.epsilon_after(1) <= self.target_epsilon

    def max_steps(self) -> int:
        """Largest total step count whose epsilon stays <= target (binary search over extra steps).

        Assumes epsilon grows with steps. Raises PrivacyBudgetError if the
        recorded steps already exceed the target, ValueError without a target.
        """
        if self.target_epsilon is None:
            raise ParameterError("max_steps() needs a target_epsilon")
        key = self._history()
        if key not in self._max_steps:
            target = self.target_epsilon
            if self.epsilon_after(0) > target:
                raise PrivacyBudgetError(f"epsilon {self.epsilon} already exceeds the target {target}")
            good, bad = 0, 1  # epsilon_after(good) <= target < epsilon_after(bad)
            while self.epsilon_after(bad) <= target:
                good, bad = bad, 2 * bad
                if bad > _MAX_SEARCH_STEPS:
                    raise PrivacyBudgetError(f"more than {_MAX_SEARCH_STEPS} steps fit in epsilon={target}")
            while bad - good > 1:
                mid = (good + bad) // 2
                if self.epsilon_after(mid) <= target:
                    good = mid
                else:
                    bad = mid
            self._max_steps[key] = self.steps + good
        return self._max_steps[key]

    def state_dict(self) -> dict[str, Any]:
        """Accountant history plus the settings it was recorded under, for checkpoints."""
        return {
            "accountant": self._accountant.state_dict(),
            "kind": self.kind,
            "delta": self.delta,
            "sample_rate": self.sample_rate,
            "noise_multiplier": self.noise_multiplier,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; refuses one recorded with other settings (its epsilon would not carry over)."""
        for name in ("kind", "delta", "sample_rate", "noise_multiplier"):
            if state.get(name) != getattr(self, name):
                raise ParameterError(
                    f"ledger state has {name}={state.get(name)!r}, this ledger {getattr(self, name)!r}; refusing to load"
                )
        load_accountant_state(self._accountant, state["accountant"])


DEFAULT_DELTA = 1e-5  # the default for data sets of up to 10,000 examples


def default_delta(num_examples: int) -> float:
    """The default delta for a data set of `num_examples`: 1e-5 while 1e-5 <= 1/(10 N), else the largest power
    of ten <= 1/(10 N) (60,000 examples: 1e-6; 1.28 million: 1e-8)."""
    ceiling = 1.0 / (10 * int(num_examples))
    if DEFAULT_DELTA <= ceiling:
        return DEFAULT_DELTA
    power = 10.0 ** math.floor(math.log10(ceiling))
    return power if power <= ceiling else power / 10  # log10 rounding


def refuse_delta(delta: float, num_examples: int, name: str = "delta") -> float:
    """Refuse delta >= 1/N: a mechanism that publishes one example in full meets such a guarantee."""
    delta = _check_delta(delta)
    if delta >= 1.0 / num_examples:
        raise PrivacyBudgetError(
            f"{name}={delta:g} >= 1/N = 1/{num_examples}: a guarantee that allows releasing one "
            f"example in full; give a delta well below 1/N (default for N = {num_examples}: "
            f"{default_delta(num_examples):g})"
        )
    return delta


def check_delta_for(delta: float, num_examples: int) -> float:
    """refuse_delta, and a warning above 1/(10 N)."""
    delta = refuse_delta(delta, num_examples)
    if delta > 1.0 / (10 * num_examples):
        warnings.warn(
            f"delta {delta:g} > 1/(10 N) = {1.0 / (10 * num_examples):.3g}: a weak guarantee for "
            f"{num_examples} examples (default for this N: {default_delta(num_examples):g})",
            stacklevel=3,
        )
    return delta
