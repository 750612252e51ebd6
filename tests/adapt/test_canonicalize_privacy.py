"""A canonicalized model under DP-SGD: per-example gradients of canonicaliser and backbone (pose prior included)
equal a naive per-example loop through DPTrainer's back-ends and make_private, and DP-safety checks accept it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from equiconvert.adapt import canonicalize, pose_prior_loss
from equiconvert.privacy import make_private
from equiconvert.privacy.dp_safety import check_dp_safe
from equiconvert.training.trainer import DPTrainer

SIZE, CLASSES, PRIOR = 10, 3, 0.5


def _model(group: str = "C4") -> nn.Module:
    """A DP-safe "pretrained" plain CNN (GroupNorm) behind a canonicaliser, weights away from their init."""
    torch.manual_seed(0)
    backbone = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.GroupNorm(2, 6),
        nn.ReLU(),
        nn.Conv2d(6, 6, 3, stride=2),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, CLASSES),
    )
    model = canonicalize(backbone, group, fields=1, kernel_size=3).train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    return model


def _naive(model: nn.Module, views: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each example's gradient of its mean loss (task + prior) over its views, one example at a time."""
    loss_fn = pose_prior_loss(model, PRIOR)
    out = {name: [] for name, _ in model.named_parameters()}
    for example, label in zip(views, labels):
        loss = loss_fn(model(example), label.expand(example.shape[0])).mean()
        for (name, _), g in zip(model.named_parameters(), torch.autograd.grad(loss, list(model.parameters()))):
            out[name].append(g)
    return {name: torch.stack(gs) for name, gs in out.items()}


def _assert_close(got: dict, expected: dict, tolerance: float = 1e-5) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert expected[name].abs().max() > 0, name  # every parameter, canonicaliser included, gets a gradient
        error = float((got[name] - expected[name]).abs().max() / expected[name].abs().max())
        assert error <= tolerance, (name, error)


def _views(examples: int = 4, views: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randn(examples, views, 3, SIZE, SIZE, generator=generator),
        torch.randint(0, CLASSES, (examples,), generator=generator),
    )


@pytest.mark.parametrize("group", ["C4", "C8"])  # C8: off-grid turns by interpolation (grid_sample)
@pytest.mark.parametrize("method", ["bookkeeping", "vmap"])
def test_dp_trainer_per_example_gradients_equal_a_naive_loop(method, group):
    views, labels = _views()
    expected = _naive(_model(group), views, labels)
    model = _model(group)
    options = dict(noise_multiplier=1.0, target_epsilon=None, batch_size=4, steps=1, aug_mult=2, ema_decay=None)
    trainer = DPTrainer(
        model, per_sample_method=method, loss_fn=pose_prior_loss(model, PRIOR), progress=False, **options
    )
    params = {n: p.detach() for n, p in trainer.model.named_parameters()}
    grads, _ = trainer._per_sample_gradients(params, dict(trainer.model.named_buffers()), views, labels)
    assert trainer.per_sample_method == method  # book-keeping's probe accepted the model: no fallback
    _assert_close(grads, expected)


def test_make_private_per_example_gradients_equal_a_naive_loop():
    views, labels = _views()
    expected = _naive(_model(), views, labels)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(views, labels), batch_size=4)
    with pytest.warns(UserWarning, match="NOT differentially private"):
        private, _, _ = make_private(
            module=model,
            optimizer=optimizer,
            data_loader=data,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            aug_mult=2,
            debug_seed=0,
        )
    loss_fn = pose_prior_loss(private, PRIOR)
    loss_fn(private(views), labels.repeat_interleave(2)).mean().backward()
    grads = private.per_sample_gradients()
    _assert_close({name: grads[p] for name, p in model.named_parameters()}, expected)


def test_dp_safety_checks_accept_a_canonicalized_model_and_training_runs():
    model = _model()
    check_dp_safe(model, torch.randn(2, 3, SIZE, SIZE))
    images, labels = torch.rand(8, 3, SIZE, SIZE), torch.randint(0, CLASSES, (8,))
    with pytest.warns(UserWarning, match="NOT differentially private"):
        trainer = DPTrainer(
            model,
            loss_fn=pose_prior_loss(model, PRIOR),
            noise_multiplier=1.0,
            target_epsilon=None,
            batch_size=4,
            steps=2,
            aug_mult=1,
            ema_decay=None,
            progress=False,
            insecure_seeded_noise=True,
            seed=0,
        )
    before = copy.deepcopy(model.canonicalizer.state_dict())
    trainer.fit((images, labels))
    assert trainer.per_sample_method == "bookkeeping"
    after = trainer.model.canonicalizer.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before if after[k].is_floating_point())
