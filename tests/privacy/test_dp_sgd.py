"""DP-SGD: per-sample gradients, clipping, noise, sampling edge cases, budget, resume, safety."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision

import equiconvert
from equiconvert.models import resnet9
from equiconvert.training.augment import augment_views
from equiconvert.privacy.dp_step import clip_and_sum, clip_factors, per_sample_norms
from equiconvert.privacy.per_sample import per_sample_gradients
from equiconvert.training.trainer import DPTrainer
from equiconvert.privacy.validate import PrivacyValidationError


def _small_model(group="C4"):
    return equiconvert.make_equivariant(resnet9(widths=(8, 16, 32), num_classes=4), group, head="invariant")


def _synthetic(n=48, size=16, classes=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)
    return images, torch.randint(0, classes, (n,), generator=generator)


def _params_and_buffers(model):
    return {n: p.detach() for n, p in model.named_parameters()}, dict(model.named_buffers())


def test_per_sample_gradients_of_d4_resnet9_with_two_views_match_naive_loop():
    model = equiconvert.make_equivariant(resnet9(), "D4", head="invariant").train()
    images = torch.randn(3, 3, 32, 32)
    views = augment_views(images, 2, torch.Generator().manual_seed(0))
    labels = torch.tensor([2, 5, 9])
    grads, losses = per_sample_gradients(model, *_params_and_buffers(model), views, labels)
    for i in range(3):
        model.zero_grad()
        loss = F.cross_entropy(model(views[i]), labels[i].expand(2))  # mean over the K=2 views
        loss.backward()
        assert torch.allclose(losses[i], loss.detach(), rtol=1e-5)
        for name, param in model.named_parameters():
            error = (grads[name][i] - param.grad).abs().max() / param.grad.abs().max().clamp_min(1e-12)
            assert error <= 1e-5, (name, float(error))


def test_per_sample_gradient_ignores_other_samples():
    model = _small_model().train()
    params, buffers = _params_and_buffers(model)
    views = augment_views(torch.randn(3, 3, 16, 16), 2, torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2])
    first, _ = per_sample_gradients(model, params, buffers, views, labels)
    changed = views.clone()
    changed[1:] = torch.randn_like(changed[1:]) * 5
    second, _ = per_sample_gradients(model, params, buffers, changed, torch.tensor([0, 3, 3]))
    for name in first:
        assert torch.allclose(first[name][0], second[name][0], rtol=1e-5, atol=1e-7), name


def test_clipping_bounds_every_per_sample_norm():
    grads = {"a": torch.randn(6, 4, 3) * torch.tensor([0.01, 0.1, 1, 3, 10, 100]).view(6, 1, 1), "b": torch.randn(6, 7)}
    norms = per_sample_norms(grads)
    factors = clip_factors(norms, 1.5)
    assert torch.all(norms * factors <= 1.5 + 1e-6)
    assert torch.all(factors[norms < 1.4] == 1.0)
    summed, _ = clip_and_sum(grads, 1.5)
    assert torch.allclose(summed["a"], (grads["a"] * factors.view(6, 1, 1)).sum(0))


class _EmptySampler:
    """Stands in for the Poisson sampler to isolate the noise (an empty logical batch)."""

    sample_rate = 0.01

    def sample(self):
        return torch.empty(0, dtype=torch.long)


def test_noise_has_the_calibrated_standard_deviation_and_empty_batch_works():
    model = _small_model()
    trainer = DPTrainer(
        model,
        noise_multiplier=3.0,
        target_epsilon=None,
        batch_size=64,
        steps=10,
        max_grad_norm=0.5,
        progress=False,
        ema_decay=None,
    )
    trainer._prepare_privacy(1000)
    trainer.sampler = _EmptySampler()
    noise, batch, _, _ = trainer._noisy_gradient(*_synthetic())
    assert batch == 0
    values = torch.cat([v.flatten() for v in noise.values()])
    expected = 3.0 * 0.5 / 64
    assert abs(float(values.mean())) < 5 * expected / values.numel() ** 0.5
    assert abs(float(values.std()) / expected - 1) < 5 / (2 * values.numel()) ** 0.5 + 1e-3
    before = copy.deepcopy(model.state_dict())
    trainer.train_step(*_synthetic())  # an empty batch still takes a (pure-noise) step
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_training_stops_before_the_budget_is_exceeded():
    trainer = DPTrainer(
        _small_model(),
        target_epsilon=2.0,
        noise_multiplier=2.5,
        batch_size=24,
        steps=200,
        aug_mult=1,
        physical_batch_size=64,
        progress=False,
        ema_decay=None,
    )
    history = trainer.fit(_synthetic())
    assert 1 <= trainer.step < 200
    assert trainer.epsilon <= 2.0
    assert trainer.ledger.epsilon_after(1) > 2.0
    assert history[-2]["event"] == "stopped" and history[-1]["epsilon"] == trainer.epsilon


def test_model_with_batch_norm_is_refused():
    with pytest.raises(PrivacyValidationError, match="bn1"):
        DPTrainer(torchvision.models.resnet18(num_classes=10), progress=False)


def _trainer(model, out_dir, steps, **options):
    """Reproducible (not private) unless options say otherwise: two separate runs are compared bit for bit."""
    options = {"insecure_seeded_noise": True, **options}
    return DPTrainer(
        model,
        target_epsilon=8.0,
        batch_size=16,
        steps=steps,
        aug_mult=2,
        lr=0.5,
        momentum=0.9,
        physical_batch_size=8,
        progress=False,
        out_dir=out_dir,
        checkpoint_every=1,
        ema_decay=0.99,
        **options,
    )


def _assert_same_weights(expected: DPTrainer, got: DPTrainer) -> None:
    for (name, a), b in zip(expected.model.state_dict().items(), got.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_resume_after_interruption_is_bit_identical(tmp_path):
    data = _synthetic()
    initial = _small_model()
    straight = _trainer(copy.deepcopy(initial), tmp_path / "straight", 4)
    straight.fit(data)

    interrupted = _trainer(copy.deepcopy(initial), tmp_path / "resumed", 4)
    interrupted._prepare_privacy(len(data[0]))
    for _ in range(2):  # killed after step 2 (its checkpoint is on disk)
        interrupted.train_step(*data)
        interrupted.save_checkpoint()
    resumed = _trainer(copy.deepcopy(initial), tmp_path / "resumed", 4)
    resumed.fit(data, resume=True)
    assert resumed.step == straight.step == 4
    assert resumed.epsilon == straight.epsilon
    _assert_same_weights(straight, resumed)
    for a, b in zip(straight.ema.state_dict()["params"].values(), resumed.ema.state_dict()["params"].values()):
        assert torch.equal(a, b)


def test_fit_logs_and_evaluates(tmp_path):
    trainer = DPTrainer(
        _small_model(),
        target_epsilon=8.0,
        batch_size=16,
        steps=3,
        aug_mult=2,
        progress=False,
        out_dir=tmp_path,
        eval_every=2,
    )
    history = trainer.fit(_synthetic(), eval_set=_synthetic(n=20, seed=1))
    final = history[-1]["final_eval"]
    assert set(final) >= {"accuracy", "loss", "brier", "ece"}
    assert 0 < trainer.epsilon <= 8.0
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert len(lines) == len(history) and '"epsilon"' in lines[-1]
    assert any("eval" in r for r in history[:-1])


def test_unknown_options_are_rejected():
    with pytest.raises(ValueError, match="unknown DPTrainer options"):
        DPTrainer(_small_model(), batchsize=10)


def test_time_limit_stops_with_a_checkpoint_and_resume_matches_an_uninterrupted_run(tmp_path):
    data = _synthetic()
    initial = _small_model()
    straight = _trainer(copy.deepcopy(initial), tmp_path / "straight", 3)
    straight.fit(data)
    limited = _trainer(copy.deepcopy(initial), tmp_path / "limited", 3)
    limited.fit(data, time_limit_s=0.0)  # stops after its first step
    assert limited.step == 1 and limited.stopped_reason == "time_limit"
    assert (tmp_path / "limited" / "checkpoint.pt").exists()
    resumed = _trainer(copy.deepcopy(initial), tmp_path / "limited", 3)
    resumed.fit(data, resume=True)
    assert resumed.step == 3 and resumed.stopped_reason is None
    _assert_same_weights(straight, resumed)


def test_cosine_schedule_and_custom_schedule_hook(tmp_path):
    cosine = DPTrainer(
        _small_model(),
        target_epsilon=8.0,
        batch_size=16,
        steps=4,
        aug_mult=1,
        lr=2.0,
        lr_schedule="cosine",
        progress=False,
    )
    lrs = [record["lr"] for record in cosine.fit(_synthetic()) if "lr" in record]
    assert lrs == pytest.approx([2.0, 2.0 * (1 + 2**-0.5) / 2, 1.0, 2.0 * (1 - 2**-0.5) / 2])
    hooked = DPTrainer(
        _small_model(),
        target_epsilon=8.0,
        batch_size=16,
        steps=2,
        aug_mult=1,
        lr_schedule=lambda step: 0.1 * (step + 1),
        progress=False,
    )
    assert [r["lr"] for r in hooked.fit(_synthetic()) if "lr" in r] == pytest.approx([0.1, 0.2])
    assert hooked.config.lr_schedule == "custom"
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        DPTrainer(_small_model(), target_epsilon=8.0, lr_schedule="step", progress=False)
