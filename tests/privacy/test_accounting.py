"""Privacy accounting and DP-safety checks against known answers.

Reference values: RDP/PRV epsilons of Opacus for sigma=1.5, q=0.04, delta=1e-5;
get_noise_multiplier for epsilon=8 over 2000 steps; and, for full-batch
(q=1) DP-SGD, the exact mu-GDP trade-off of the composed Gaussian mechanism.
"""

from __future__ import annotations

import math
import re
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from torch import nn

from equiconvert.errors import EquiconvertError
from equiconvert.privacy import accounting
from equiconvert.privacy.accounting import (
    ACCOUNTANTS,
    LooseBoundWarning,
    PrivacyBudgetError,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compute_epsilon,
    make_accountant,
)
from equiconvert.privacy.validate import PrivacyValidationError, validate_dp_safe

SIGMA, RATE, DELTA = 1.5, 0.04, 1e-5


# --- compute_epsilon: known answers -----------------------------------------
def test_rdp_known_answers() -> None:
    assert compute_epsilon("rdp", SIGMA, RATE, 2250, DELTA) == pytest.approx(7.32911117143, abs=1e-7)
    assert compute_epsilon("rdp", SIGMA, RATE, 2249, DELTA) == pytest.approx(7.32728, abs=5e-5)


def test_prv_known_answers() -> None:
    assert compute_epsilon("prv", SIGMA, RATE, 2249, DELTA) == pytest.approx(6.777395712150674, abs=5e-5)
    assert compute_epsilon("prv", SIGMA, RATE, 2250, DELTA) == pytest.approx(6.779132, abs=5e-5)


def test_zero_steps_cost_nothing_and_bad_arguments_are_refused() -> None:
    assert compute_epsilon("rdp", SIGMA, RATE, 0, DELTA) == 0.0
    with pytest.raises(ValueError, match="unknown accountant"):
        compute_epsilon("moments", SIGMA, RATE, 10, DELTA)
    for kwargs in ({"noise_multiplier": 0.0}, {"sample_rate": 1.5}, {"delta": 1.0}, {"steps": -1}):
        args = {"kind": "rdp", "noise_multiplier": SIGMA, "sample_rate": RATE, "steps": 10, "delta": DELTA, **kwargs}
        with pytest.raises(ValueError):
            compute_epsilon(**args)
    with pytest.raises(TypeError):
        compute_epsilon("rdp", SIGMA, RATE, 2.5, DELTA)


def test_make_accountant() -> None:
    assert ACCOUNTANTS == ("rdp", "prv")
    assert make_accountant("rdp").mechanism() == "rdp"
    assert make_accountant("prv").mechanism() == "prv"
    with pytest.raises(ValueError, match="unknown accountant 'moments'"):
        make_accountant("moments")
    # Opacus' GDP accountant (an approximation): the Opacus front-end's only, never a trainer or CLI choice
    assert "gdp" not in ACCOUNTANTS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Opacus' per-construction warning is silenced; engine.py warns once
        assert make_accountant("gdp").mechanism() == "gdp"


# --- full batch: exact mu-GDP ------------------------------------------------
def _gdp_delta(eps: float, mu: float) -> float:
    return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2)


def test_full_batch_matches_gaussian_dp_closed_form() -> None:
    sigma, steps, delta = 2.0, 10, 1e-5
    mu = math.sqrt(steps) / sigma  # T-fold composition of the Gaussian mechanism is mu-GDP
    exact = brentq(lambda e: _gdp_delta(e, mu) - delta, 0.0, 50.0, xtol=1e-12)  # 7.5113
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # Opacus' PRV takes log(1 - q) = log(0) at q = 1
        prv = compute_epsilon("prv", sigma, 1.0, steps, delta)  # measured 7.5216
    rdp = compute_epsilon("rdp", sigma, 1.0, steps, delta)  # measured 8.0794
    # PRV returns an upper bound within its eps_error: measured prv - exact = 0.0104.
    assert exact <= prv <= exact + 0.05
    assert _gdp_delta(prv, mu) <= delta  # so (prv, delta)-DP really holds
    assert rdp >= exact  # RDP is an upper bound


# --- calibration -------------------------------------------------------------
@pytest.mark.parametrize("kind, expected", [("rdp", 1.3562), ("prv", 1.2915)])
def test_calibrated_sigma_reaches_target_without_exceeding(kind: str, expected: float) -> None:
    sigma = calibrate_noise_multiplier(8.0, DELTA, RATE, 2000, kind)
    assert sigma == pytest.approx(expected, abs=2e-3)
    eps = compute_epsilon(kind, sigma, RATE, 2000, DELTA)
    assert 7.99 <= eps <= 8.0


@pytest.mark.parametrize("factor", [0.99, 1.2])
def test_calibration_repairs_a_proposal_above_or_far_below_target(monkeypatch, factor: float) -> None:
    true_sigma = calibrate_noise_multiplier(8.0, DELTA, RATE, 2000, "rdp")
    monkeypatch.setattr(accounting, "get_noise_multiplier", lambda **kwargs: true_sigma * factor)
    proposed = compute_epsilon("rdp", true_sigma * factor, RATE, 2000, DELTA)
    assert (proposed > 8.0) if factor < 1 else (proposed < 7.99)
    sigma = calibrate_noise_multiplier(8.0, DELTA, RATE, 2000, "rdp")
    assert 7.99 <= compute_epsilon("rdp", sigma, RATE, 2000, DELTA) <= 8.0


def test_unreachable_target_is_a_clear_error() -> None:
    with pytest.raises(
        PrivacyBudgetError, match=r"unreachable.*smallest epsilon RDP certifies here is 0\.0084; the PRV"
    ):
        calibrate_noise_multiplier(1e-7, DELTA, RATE, 2000, "rdp")
    assert issubclass(PrivacyBudgetError, EquiconvertError)


# --- RDP orders beyond Opacus' default 63 -----------------------------------------
def _opacus_rdp_epsilon(sigma: float, rate: float, steps: int, orders: list[float]) -> float:
    """Epsilon straight from Opacus' analysis functions over explicit orders (no accountant class)."""
    rdp = rdp_analysis.compute_rdp(q=rate, noise_multiplier=sigma, steps=steps, orders=orders)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return float(rdp_analysis.get_privacy_spent(orders=orders, rdp=rdp, delta=DELTA)[0])


def test_small_budgets_get_the_tighter_bound_of_more_orders() -> None:
    # With Opacus' default orders (<= 63) no noise certifies epsilon 0.1 here: the bound stays above 0.1029.
    default_orders = RDPAccountant.DEFAULT_ALPHAS
    wide_orders = default_orders + [80, 96, 128, 160, 192, 256, 320, 384, 512]
    sigma = calibrate_noise_multiplier(0.1, DELTA, 0.01, 100, "rdp")
    eps = compute_epsilon("rdp", sigma, 0.01, 100, DELTA)
    assert 0.09 <= eps <= 0.1
    assert eps == pytest.approx(_opacus_rdp_epsilon(sigma, 0.01, 100, wide_orders), rel=1e-12)
    assert _opacus_rdp_epsilon(sigma, 0.01, 100, default_orders) > 0.1
    assert _opacus_rdp_epsilon(1e6, 0.01, 100, default_orders) > 0.1
    # RDP stays an upper bound: PRV (close to exact, measured 0.0959 here) is not above it.
    assert compute_epsilon("prv", sigma, 0.01, 100, DELTA) <= eps


def test_more_orders_leave_ordinary_budgets_unchanged() -> None:
    for sigma, rate, steps in [(SIGMA, RATE, 2250), (1.8115, 2048 / 60000, 1000), (4.98, 8192 / 50000, 2200)]:
        assert compute_epsilon("rdp", sigma, rate, steps, DELTA) == pytest.approx(
            _opacus_rdp_epsilon(sigma, rate, steps, RDPAccountant.DEFAULT_ALPHAS), rel=1e-12
        )


@pytest.mark.parametrize("kind", ACCOUNTANTS)
def test_calibration_and_accounting_do_not_warn_for_an_ordinary_run(kind: str) -> None:
    # Opacus' search (and PRV's domain sizing) visit sigmas whose best order is the largest one;
    # those warnings said nothing about the run and used to appear in every log.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sigma = calibrate_noise_multiplier(3.0, DELTA, 2048 / 60000, 1000, kind)
        compute_epsilon(kind, sigma, 2048 / 60000, 1000, DELTA)


def test_prv_small_budgets_do_not_warn_about_its_internal_domain_bound() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert 0.0 < compute_epsilon("prv", 20.0, 0.01, 100, DELTA) < 0.05  # measured 0.0228


@pytest.mark.filterwarnings("ignore:RDP.s epsilon .* smallest order")  # true of 1e12 full-batch steps
def test_a_target_reachable_only_near_the_noise_ceiling_is_calibrated() -> None:
    # Opacus' proposal gives up once its doubling passes sigma 1e6 (here 1.28e6), although 7.9e5 suffices.
    steps = 10**12
    sigma = calibrate_noise_multiplier(6.24, DELTA, 1.0, steps, "rdp")
    assert 6.23 <= compute_epsilon("rdp", sigma, 1.0, steps, DELTA) <= 6.24


def test_silencing_from_threads_leaves_no_warning_filter_behind() -> None:
    filters_before = list(warnings.filters)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: calibrate_noise_multiplier(3.0, DELTA, 2048 / 60000, 1000, "rdp"), range(8)))
    assert warnings.filters == filters_before


def test_epsilon_is_never_reported_below_zero() -> None:
    # Opacus' conversion gives -0.000645 here (a valid but meaningless bound).
    with pytest.warns(LooseBoundWarning, match="largest order"):  # and RDP says its bound is loose
        assert compute_epsilon("rdp", 1e6, 1e-4, 10**7, 1e-3) == 0.0


def test_a_final_epsilon_at_the_largest_order_still_warns() -> None:
    with pytest.warns(LooseBoundWarning, match="largest order"):
        compute_epsilon("rdp", 50.0, 0.01, 10, DELTA)


def test_a_run_at_a_tiny_epsilon_gives_one_warning_of_ours_and_none_of_opacus() -> None:
    """Opacus warned "Optimal order is the largest alpha" at each epsilon the calibration and the ledger computed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sigma = calibrate_noise_multiplier(0.03, DELTA, 0.25, 3, "rdp")
        ledger = PrivacyLedger("rdp", DELTA, 0.03, 0.25, sigma)
        for _ in range(ledger.max_steps()):
            ledger.step()
            assert 0 < ledger.epsilon <= 0.03
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and caught[0].category is LooseBoundWarning, messages
    assert re.fullmatch(
        r"RDP's epsilon 0\.0\d+ at delta 1e-05 is tightest at its largest order \(512\): the bound is loose "
        r"there; accountant='prv' gives a tighter epsilon",
        messages[0],
    )


# --- ledger --------------------------------------------------------------------
def test_ledger_epsilon_grows_and_matches_compute_epsilon() -> None:
    ledger = PrivacyLedger("rdp", DELTA, None, RATE, SIGMA)
    assert ledger.steps == 0 and ledger.epsilon == 0.0 and ledger.can_step()
    previous = 0.0
    for _ in range(20):
        ledger.step()
        assert ledger.epsilon > previous
        previous = ledger.epsilon
    assert ledger.steps == 20
    assert ledger.epsilon == compute_epsilon("rdp", SIGMA, RATE, 20, DELTA)
    assert ledger.epsilon_after(2230) == pytest.approx(7.32911117143, abs=1e-7)
    assert ledger.steps == 20  # epsilon_after does not record steps
    with pytest.raises(ValueError):
        ledger.max_steps()


def test_ledger_stops_before_the_budget_is_exceeded() -> None:
    target = 3.0
    ledger = PrivacyLedger("rdp", DELTA, target, 0.05, 1.0)  # 41 steps fit
    planned = ledger.max_steps()
    while ledger.can_step():
        ledger.step()
    assert ledger.epsilon <= target < ledger.epsilon_after(1)
    assert ledger.steps == planned > 0
    assert ledger.max_steps() == planned


def test_ledger_max_steps_prv_agrees_with_known_answers() -> None:
    # eps(2249) = 6.77740 <= 6.778 < eps(2250) = 6.77913 (known PRV answers above)
    ledger = PrivacyLedger("prv", DELTA, 6.778, RATE, SIGMA)
    ledger._accountant.history = [(SIGMA, RATE, 2240)]  # skip 2240 individual step() calls
    assert ledger.max_steps() == 2249


def test_ledger_state_dict_round_trip() -> None:
    ledger = PrivacyLedger("rdp", DELTA, 8.0, RATE, SIGMA)
    for _ in range(7):
        ledger.step()
    state = ledger.state_dict()
    ledger.step()  # must not leak into the saved state
    resumed = PrivacyLedger("rdp", DELTA, 8.0, RATE, SIGMA)
    resumed.load_state_dict(state)
    assert resumed.steps == 7
    assert resumed.epsilon == compute_epsilon("rdp", SIGMA, RATE, 7, DELTA)
    resumed.step()
    assert resumed.epsilon == ledger.epsilon
    with pytest.raises(ValueError, match="noise_multiplier"):
        PrivacyLedger("rdp", DELTA, 8.0, RATE, 2 * SIGMA).load_state_dict(state)
    with pytest.raises(ValueError, match="kind"):
        PrivacyLedger("prv", DELTA, 8.0, RATE, SIGMA).load_state_dict(state)


def test_ledger_refuses_unknown_accountant_and_bad_settings() -> None:
    with pytest.raises(ValueError, match="unknown accountant"):
        PrivacyLedger("moments", DELTA, 8.0, RATE, SIGMA)
    with pytest.raises(ValueError):
        PrivacyLedger("rdp", DELTA, -1.0, RATE, SIGMA)
    with pytest.raises(ValueError):
        PrivacyLedger("rdp", DELTA, 8.0, 0.0, SIGMA)


# --- validate_dp_safe -----------------------------------------------------------
def test_all_batch_norms_are_reported_in_one_error() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)),
    )
    with pytest.raises(PrivacyValidationError) as info:
        validate_dp_safe(model)
    message = str(info.value)
    assert "1 (torch.nn.modules.batchnorm.BatchNorm2d)" in message
    assert "4.1 (torch.nn.modules.batchnorm.BatchNorm1d)" in message
    assert "2 module(s)" in message and "GroupNorm" in message and "make_equivariant" in message
    assert isinstance(info.value, EquiconvertError)


def test_batch_norm_is_rejected_in_eval_mode_and_as_root() -> None:
    with pytest.raises(PrivacyValidationError, match="<root>"):
        validate_dp_safe(nn.BatchNorm2d(4, track_running_stats=False).eval())


def test_group_norm_model_passes() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.GroupNorm(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.InstanceNorm2d(8), nn.LayerNorm([8])
    )
    validate_dp_safe(model)


def test_instance_norm_with_running_stats_is_rejected() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8, track_running_stats=True))
    with pytest.raises(PrivacyValidationError, match=r"1 \(torch.nn.modules.instancenorm.InstanceNorm2d\)"):
        validate_dp_safe(model)


def test_escnn_batch_norm_is_rejected_without_importing_escnn() -> None:
    IIDBatchNorm2d = type("IIDBatchNorm2d", (nn.Module,), {"__module__": "escnn.nn.modules.batchnormalization.iid"})
    model = nn.Sequential(nn.Conv2d(3, 8, 3), IIDBatchNorm2d())
    with pytest.raises(
        PrivacyValidationError, match=r"1 \(escnn\.nn\.modules\.batchnormalization\.iid\.IIDBatchNorm2d\)"
    ):
        validate_dp_safe(model)


def test_any_module_with_running_statistics_is_rejected() -> None:
    class FieldNorm(nn.Module):  # escnn-style per-field buffer name
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("regular_running_var", torch.ones(4))

    class Wrapper(nn.Module):  # outermost offender only: its inner batch norm is not listed again
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("running_mean", torch.zeros(4))
            self.inner = nn.BatchNorm1d(4)

    with pytest.raises(PrivacyValidationError) as info:
        validate_dp_safe(nn.Sequential(FieldNorm(), Wrapper()))
    message = str(info.value)
    assert "2 module(s)" in message and "regular_running_var" in message and "1.inner" not in message
