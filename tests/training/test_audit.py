"""The one-run privacy audit: its bound against hand-computed answers, and against broken and real DP-SGD."""

from __future__ import annotations

import json
import math

import pytest
import torch
from scipy.stats import binom
from torch import nn

from equiconvert.adapt.canonicalize import CanonicalizedModel
from equiconvert.cli import main
from equiconvert.data import load_dataset
from equiconvert.training import audit
from equiconvert.training.audit import SCORES, count_correct, make_canaries, run_audit
from equiconvert.training.audit_options import AUDIT_DEFAULTS
from equiconvert.privacy.audit_bound import epsilon_lower_bound, guess_tail_bound
from equiconvert.training.trainer import DPTrainer

CLAIMED_EPSILON = 1.0
CANARIES, GUESSES = 200, 20  # 20 guessed included, 20 excluded: 40 right guesses bound epsilon by about 2.5


def _all_correct_bound(guesses: int, beta: float) -> float:
    """delta = 0, every guess right: P[Binomial(r, p) >= r] = p^r = beta, so p = beta^(1/r), eps = logit(p)."""
    p = beta ** (1.0 / guesses)
    return math.log(p / (1.0 - p))


@pytest.mark.parametrize("guesses", [5, 10, 40])
def test_all_correct_bound_matches_closed_form(guesses):
    assert epsilon_lower_bound(guesses, guesses, 1000, delta=0.0, beta=0.05) == pytest.approx(
        _all_correct_bound(guesses, 0.05), abs=1e-9
    )


def test_ten_of_ten_correct_bound_epsilon_by_1_052():
    assert epsilon_lower_bound(10, 10, 10, delta=0.0, beta=0.05) == pytest.approx(
        1.0519, abs=1e-4
    )  # logit(0.05 ** 0.1)


def test_no_or_chance_level_correct_guesses_bound_nothing():
    assert epsilon_lower_bound(0, 100, 1000, delta=1e-5) == 0.0
    assert epsilon_lower_bound(50, 100, 1000, delta=1e-5) == 0.0  # half right: what coin flips get
    assert epsilon_lower_bound(55, 100, 1000, delta=0.0) == 0.0  # within chance at 95%


@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-3])
def test_bound_is_monotone_in_correct_guesses(delta):
    bounds = [epsilon_lower_bound(v, 100, 1000, delta=delta) for v in range(0, 101, 2)]
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    assert bounds[45] < bounds[50]  # 90 and 100 right
    if delta <= 1e-5:
        assert 0 < bounds[30] < bounds[40] < bounds[45]  # 60, 80, 90 right


def test_large_delta_weakens_the_bound():
    """2 m delta = 2 with 1000 canaries at delta 1e-3: 80 of 100 right no longer rejects any epsilon."""
    assert epsilon_lower_bound(80, 100, 1000, delta=1e-3) == 0.0 < epsilon_lower_bound(80, 100, 1000, delta=1e-5)


def test_delta_term_matches_hand_computation():
    """r = m = 2, v = 2: p^2 + 2 m delta max(P[B = 1] / 1, P[0 <= B < 2] / 2)."""
    epsilon, delta = 0.7, 0.01
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    expected = p**2 + 4 * delta * max(2 * p * (1 - p), (1 - p**2) / 2)
    assert guess_tail_bound(epsilon, 2, 2, 2, delta) == pytest.approx(expected, rel=1e-12)


def test_delta_term_matches_the_maximum_over_every_shift():
    """The bound takes the maximum over i = 1..m; windows for i >= v are all P[B < v], so it stops at i = v."""
    epsilon, correct, guesses, canaries, delta = 0.9, 30, 50, 200, 1e-4
    p = math.exp(epsilon) / (1 + math.exp(epsilon))
    below = [binom.cdf(k, guesses, p) for k in range(-canaries - 1, guesses + 1)]  # below[k + m + 1] = P[B <= k]
    cdf = lambda k: below[k + canaries + 1]  # noqa: E731
    term = max((cdf(correct - 1) - cdf(correct - 1 - i)) / i for i in range(1, canaries + 1))
    expected = binom.sf(correct - 1, guesses, p) + 2 * canaries * delta * term
    assert guess_tail_bound(epsilon, correct, guesses, canaries, delta) == pytest.approx(expected, rel=1e-12)


def test_bound_sits_where_the_tail_bound_reaches_beta():
    bound = epsilon_lower_bound(90, 100, 1000, delta=1e-5, beta=0.05)
    assert bound > 0
    assert guess_tail_bound(bound, 90, 100, 1000, 1e-5) <= 0.05 < guess_tail_bound(bound + 1e-6, 90, 100, 1000, 1e-5)
    assert bound < epsilon_lower_bound(90, 100, 1000, delta=0.0, beta=0.05)  # delta > 0 weakens the evidence
    assert bound < epsilon_lower_bound(90, 100, 1000, delta=1e-5, beta=0.2)  # less confidence, a higher bound


def test_bound_rejects_impossible_counts():
    with pytest.raises(ValueError, match="correct"):
        epsilon_lower_bound(11, 10, 100)
    with pytest.raises(ValueError, match="beta"):
        epsilon_lower_bound(5, 10, 100, beta=1.0)


def test_count_correct_guesses_top_included_and_bottom_excluded():
    scores = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    included = torch.tensor([True, False, True, False, True, False])
    assert count_correct(scores, included, 2, 2) == 1 + 1  # top {0, 1}: 0 right; bottom {4, 5}: 5 right
    assert count_correct(scores, included, 1, 0) == 1
    with pytest.raises(ValueError, match="k\\+"):
        count_correct(scores, included, 4, 3)


def test_gradient_score_measures_the_step_along_a_canary_gradient(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    images, labels = torch.randn(7, 1, 3, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0])
    initial = {name: param.detach().clone() for name, param in model.named_parameters()}
    loss = nn.functional.cross_entropy(model(images[2:3]), labels[2:3])
    gradients = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for param, gradient in zip(model.parameters(), gradients):
            param -= 0.5 * gradient  # one gradient step on canary 2 alone
    norm = torch.sqrt(sum(g.pow(2).sum() for g in gradients))
    scores = SCORES["gradient"](model, initial, images, labels)
    assert scores[2] == pytest.approx(0.5 * float(norm), rel=1e-5)
    assert int(scores.argmax()) == 2
    monkeypatch.setattr(audit, "SCORE_CHUNK", 3)  # scored in chunks of 3, 3 and 1: the same scores
    assert torch.allclose(SCORES["gradient"](model, initial, images, labels), scores, atol=1e-6)
    with torch.no_grad():
        expected_loss = float(nn.functional.cross_entropy(model(images[2:3]), labels[2:3]))
    assert SCORES["loss"](model, initial, images, labels)[2] == pytest.approx(-expected_loss)


class NoiselessTrainer(DPTrainer):
    """A broken DP-SGD: the accountant is told the calibrated sigma, but no noise is added."""

    def _prepare_privacy(self, num_examples: int) -> None:
        super()._prepare_privacy(num_examples)
        self.noise_multiplier = 0.0


def _audit(trainer_class: type[DPTrainer], score: str, seed: int):
    data = load_dataset("synthetic", num_examples=512, image_size=16, channels=3)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, data.num_classes))
    canaries = make_canaries(data.image_shape, data.num_classes, CANARIES, seed=seed + 100)
    options = {**AUDIT_DEFAULTS, "target_epsilon": CLAIMED_EPSILON, "delta": 1e-5, "seed": seed}
    return run_audit(
        model,
        data.as_tuple(),
        canaries,
        guesses_included=GUESSES,
        guesses_excluded=GUESSES,
        score=score,
        inclusion_seed=seed,
        trainer_class=trainer_class,
        device="cpu",
        **options,
    )


@pytest.mark.parametrize("score", sorted(SCORES))
def test_audit_catches_a_mechanism_without_noise(score):
    result = _audit(NoiselessTrainer, score, seed=0)
    assert result.noise_multiplier == 0.0  # the breakage took effect
    assert result.accountant_epsilon <= CLAIMED_EPSILON
    assert result.epsilon_lower_bound > CLAIMED_EPSILON
    assert result.correct_guesses >= 36 and result.steps == AUDIT_DEFAULTS["steps"]
    assert result.epsilon_lower_bound <= result.largest_possible_bound < _all_correct_bound(2 * GUESSES, 0.05)


@pytest.mark.parametrize("trainer_class", [NoiselessTrainer, DPTrainer])
def test_the_audit_runs_on_a_canonicalized_model_and_tells_noise_from_none(trainer_class):
    """`--model canonicalized_cnn`: the adapted models' training is audited as any other. With few training examples
    the canaries dominate the batches, so the black-box loss score sees a run without noise at once."""
    data = load_dataset("synthetic", num_examples=16, image_size=16, channels=3)
    torch.manual_seed(0)
    model = audit.SMALL_MODELS["canonicalized_cnn"](data.image_shape, data.num_classes)
    assert isinstance(model, CanonicalizedModel)
    canaries = make_canaries(data.image_shape, data.num_classes, CANARIES, seed=100)
    options = {**AUDIT_DEFAULTS, "target_epsilon": CLAIMED_EPSILON, "delta": 1e-5, "seed": 0, "lr": 2.0}
    result = run_audit(
        model,
        data.as_tuple(),
        canaries,
        guesses_included=GUESSES,
        guesses_excluded=GUESSES,
        score="loss",
        trainer_class=trainer_class,
        device="cpu",
        **options | {"batch_size": 32},
    )
    assert result.steps == AUDIT_DEFAULTS["steps"] and result.accountant_epsilon <= CLAIMED_EPSILON
    if trainer_class is NoiselessTrainer:  # the broken mechanism is caught: more than the claimed epsilon
        assert result.epsilon_lower_bound > CLAIMED_EPSILON
    else:
        assert result.noise_multiplier > 1.0 and result.epsilon_lower_bound < result.accountant_epsilon


@pytest.mark.parametrize("seed", [0, 1])
def test_audit_of_the_real_trainer_stays_below_its_accountant(seed):
    result = _audit(DPTrainer, "gradient", seed)
    assert result.noise_multiplier > 1.0
    assert CLAIMED_EPSILON - 0.02 <= result.accountant_epsilon <= CLAIMED_EPSILON
    assert result.epsilon_lower_bound < result.accountant_epsilon
    assert 0 < result.num_included < CANARIES and result.confidence == pytest.approx(0.95)
    assert result.guesses_included == result.guesses_excluded == GUESSES


def test_run_audit_refuses_bad_arguments_before_training():
    data = load_dataset("synthetic", num_examples=64, image_size=8, channels=1)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, data.num_classes))
    canaries = make_canaries(data.image_shape, data.num_classes, 10, seed=0)
    with pytest.raises(ValueError, match="k\\+"):
        run_audit(model, data.as_tuple(), canaries, guesses_included=6, guesses_excluded=5, device="cpu")
    with pytest.raises(ValueError, match="unknown audit score 'mia'"):
        run_audit(model, data.as_tuple(), canaries, guesses_included=2, guesses_excluded=2, score="mia")
    with pytest.raises(ValueError, match="shape and dtype"):
        run_audit(
            model,
            data.as_tuple(),
            make_canaries((3, 8, 8), data.num_classes, 10, seed=0),
            guesses_included=2,
            guesses_excluded=2,
        )
    with pytest.raises(ValueError, match="at least 2 canaries"):
        make_canaries(data.image_shape, data.num_classes, 1, seed=0)


def test_audit_cli_writes_json_and_refuses_a_non_empty_out(tmp_path, capsys):
    out = tmp_path / "audit"
    argv = [
        "audit",
        "--out",
        str(out),
        "--num-examples",
        "128",
        "--canaries",
        "60",
        "--guesses",
        "10",
        "--steps",
        "20",
        "--batch-size",
        "32",
        "--device",
        "cpu",
    ]
    assert main(argv) == 0
    record = json.loads((out / "audit.json").read_text())
    assert json.loads(capsys.readouterr().out) == record
    assert record["num_canaries"] == 60 and record["steps"] == 20 and record["guesses_included"] == 10
    assert 0.0 <= record["epsilon_lower_bound"] < record["accountant_epsilon"] <= AUDIT_DEFAULTS["target_epsilon"]
    assert main(argv) == 2
    assert "--out" in capsys.readouterr().err


def test_audit_cli_trains_the_canonicalized_model(tmp_path, capsys):
    out = tmp_path / "audit"
    argv = ["audit", "--out", str(out), "--model", "canonicalized_cnn", "--num-examples", "64", "--canaries", "20"]
    assert main([*argv, "--guesses", "4", "--steps", "5", "--batch-size", "16", "--device", "cpu"]) == 0
    record = json.loads((out / "audit.json").read_text())
    assert record["model"] == "canonicalized_cnn" and record["dataset"] == "synthetic" and record["steps"] == 5
    assert 0.0 <= record["epsilon_lower_bound"] <= record["largest_possible_bound"]


def test_audit_cli_refuses_bad_flags(tmp_path, capsys):
    assert main(["audit", "--out", str(tmp_path / "a"), "--canaries", "10", "--guesses", "6"]) == 2
    assert "--guesses" in capsys.readouterr().err
    assert main(["audit", "--out", str(tmp_path / "a"), "--num-examples", "-5"]) == 2
    assert "--num-examples" in capsys.readouterr().err
    assert main(["audit", "--out", str(tmp_path / "a"), "--confidence", "1"]) == 2
    assert "--confidence" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_the_command_lines_score_and_model_names_are_the_registries():
    """`equiconvert audit --help` lists them from training.audit_options, which loads no torch."""
    from equiconvert.training.audit_options import SCORE_NAMES, SMALL_MODEL_NAMES

    assert tuple(audit.SCORES) == SCORE_NAMES and tuple(audit.SMALL_MODELS) == SMALL_MODEL_NAMES
