"""The epsilon lower bound of a one-run privacy audit from its count of correct guesses.

Steinke, Nasr and Jagielski, "Privacy auditing with one (1) training run" (NeurIPS 2023), main
theorem: if training is (eps, delta)-DP with respect to adding or removing one of m canaries, each
included independently with probability 1/2, and an auditor makes r guesses about which canaries
were included, then its number of correct guesses W satisfies, for every v,

    P[W >= v] <= P[B >= v] + 2 m delta * max_{i = 1..m} P[v - i <= B < v] / i,
    B ~ Binomial(r, e^eps / (1 + e^eps)).

Observing W = v where the right-hand side is at most beta rejects "(eps, delta)-DP" at confidence
1 - beta. The right-hand side grows with eps, so the rejected eps form an interval [0, eps_lower]:
eps_lower is the audit's lower bound, and a mechanism that really is (eps, delta)-DP shows
eps_lower > eps with probability at most beta.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit
from scipy.stats import binom

from ..errors import ParameterError

BISECTION_STEPS = 80  # halvings of the search interval: far below float resolution of eps
EPSILON_CEILING = 64.0  # expit(64) == 1.0 in float64: the tail bound is 1 there whenever correct >= 0


def guess_tail_bound(epsilon: float, correct: int, guesses: int, num_canaries: int, delta: float) -> float:
    """The theorem's bound on P[W >= correct] for an (epsilon, delta)-DP mechanism."""
    p = float(expit(epsilon))
    tail = float(binom.sf(correct - 1, guesses, p))  # P[B >= correct]
    if delta == 0.0:
        return tail
    # for i >= correct the window is P[B < correct], the same for every i: its largest ratio is at i = correct
    shifts = np.arange(1, max(correct, 1) + 1)
    below = binom.cdf(correct - 1, guesses, p)  # P[B < correct]
    windows = below - binom.cdf(correct - 1 - shifts, guesses, p)  # P[correct - i <= B < correct]
    return tail + 2.0 * num_canaries * delta * float(np.max(windows / shifts))


def _check_counts(correct: int, guesses: int, num_canaries: int, delta: float, beta: float) -> None:
    if not 0 <= correct <= guesses <= num_canaries:
        raise ParameterError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= canaries ({num_canaries})")
    if not 0.0 <= delta < 1.0:
        raise ParameterError(f"delta must lie in [0, 1), got {delta}")
    if not 0.0 < beta < 1.0:
        raise ParameterError(f"beta (1 - confidence) must lie in (0, 1), got {beta}")


def epsilon_lower_bound(correct: int, guesses: int, num_canaries: int, delta: float = 0.0, beta: float = 0.05) -> float:
    """The largest epsilon that `correct` right guesses out of `guesses` reject at confidence 1 - beta.

    0.0 when no epsilon is rejected (e.g. no correct guesses, or no more than chance).
    """
    _check_counts(correct, guesses, num_canaries, delta, beta)

    def rejected(epsilon: float) -> bool:
        return guess_tail_bound(epsilon, correct, guesses, num_canaries, delta) <= beta

    if correct == 0 or not rejected(0.0):
        return 0.0
    low, high = 0.0, EPSILON_CEILING
    for _ in range(BISECTION_STEPS):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if rejected(middle) else (low, middle)
    return low
