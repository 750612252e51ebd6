"""The DP-SGD step (dp_step.py) against a naive per-example loop, and both front-ends taking the same step."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from equiconvert.privacy.dp_step import CLIP_EPS, clip_and_accumulate, per_sample_norms, privatize
from equiconvert.privacy.engine import make_private
from equiconvert.privacy.per_sample import per_sample_gradients
from equiconvert.privacy.secure_rng import NOISE, RandomSource
from equiconvert.training.trainer import DPTrainer
from tests.support.tiny import N, linear_classifier, perturbed, tiny_images

C = 1.0


def _gradients(seed: int = 0, batch: int = 7) -> dict[str, torch.Tensor]:
    """Per-example gradients of three parameters, a scalar one among them: norms from well below C to far above;
    examples 2 and 5 non-finite."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 2, batch)
    grads = {
        "weight": torch.randn(batch, 3, 4, generator=generator) * scale.view(-1, 1, 1),
        "bias": torch.randn(batch, 3, generator=generator) * scale.view(-1, 1),
        "gain": torch.randn(batch, generator=generator) * scale,
    }
    grads["weight"][2, 1, 0] = float("nan")
    grads["bias"][5, 2] = float("inf")
    return grads


def _naive(grads: dict[str, torch.Tensor], max_grad_norm: float) -> tuple[dict[str, torch.Tensor], int]:
    """Example by example: skip a non-finite one, else scale its whole gradient by min(1, C / (norm + eps))."""
    total = {name: torch.zeros(g.shape[1:], dtype=torch.float64) for name, g in grads.items()}
    dropped = 0
    for i in range(next(iter(grads.values())).shape[0]):
        example = {name: g[i].double() for name, g in grads.items()}
        if not all(torch.isfinite(v).all() for v in example.values()):
            dropped += 1
            continue
        norm = math.sqrt(sum(float(v.pow(2).sum()) for v in example.values()))
        factor = min(1.0, max_grad_norm / (norm + CLIP_EPS))
        for name, v in example.items():
            total[name] += factor * v
    return total, dropped


def test_clip_and_accumulate_matches_a_naive_per_example_loop():
    first, second = _gradients(0), _gradients(1)
    into: dict[str, torch.Tensor] = {}
    dropped = clip_and_accumulate(first, C, into) + clip_and_accumulate(second, C, into)
    expected_first, dropped_first = _naive(first, C)
    expected_second, dropped_second = _naive(second, C)
    assert int(dropped) == dropped_first + dropped_second == 4
    for name, value in into.items():
        assert value.dtype == torch.float32 and torch.isfinite(value).all()
        torch.testing.assert_close(value.double(), expected_first[name] + expected_second[name], rtol=1e-5, atol=1e-6)


def test_one_example_moves_the_sum_by_at_most_the_clip_norm():
    huge = {"weight": torch.full((1, 3, 4), 1e6), "bias": torch.full((1, 3), -1e6)}
    into: dict[str, torch.Tensor] = {}
    clip_and_accumulate(huge, C, into)
    norm = math.sqrt(sum(float(v.pow(2).sum()) for v in into.values()))
    assert norm <= C and norm == pytest.approx(C, rel=1e-5)


def test_an_empty_batch_adds_nothing():
    into = {"bias": torch.ones(3)}
    assert clip_and_accumulate({}, C, into) == 0
    assert torch.equal(into["bias"], torch.ones(3))


def test_privatize_adds_the_seeded_noise_once_then_reduces_then_divides():
    summed = {"weight": torch.randn(200, 300), "bias": torch.randn(50)}
    sigma, divisor = 1.5, 8.0
    noisy = privatize(summed, sigma, C, RandomSource.seeded_from(3, NOISE), divisor)
    replay = RandomSource.seeded_from(3, NOISE)  # the noise is drawn in the order of `summed`
    for name, value in summed.items():
        assert torch.equal(noisy[name], (value + replay.gaussian(value.shape, sigma * C)) / divisor)
    noise = noisy["weight"] * divisor - summed["weight"]  # 60,000 draws: mean 0, std sigma * C
    assert abs(float(noise.mean())) < 0.02 and float(noise.std()) == pytest.approx(sigma * C, rel=0.02)

    reduced: list[list[torch.Tensor]] = []

    def two_ranks(tensors):  # what an all-reduce over two ranks holding the same sums gives
        reduced.append(list(tensors))
        return [2 * t for t in tensors]

    source = RandomSource.seeded_from(3, NOISE)
    quiet = privatize(summed, sigma, C, source, divisor, add_noise=False, all_reduce=two_ranks)
    assert [torch.equal(a, b) for a, b in zip(reduced[0], summed.values())] == [True, True]  # a rank without noise
    assert all(torch.equal(quiet[n], 2 * summed[n] / divisor) for n in summed)
    assert torch.equal(source.gaussian((4,), 1.0), RandomSource.seeded_from(3, NOISE).gaussian((4,), 1.0))  # unused


def test_the_step_never_waits_for_the_device(monkeypatch):
    """No .item(), bool(), int() or float() of a tensor: DPTrainer's loop queues the step without a sync."""

    def synchronises(*_args, **_kwargs):
        raise AssertionError("host synchronisation in the DP step")

    for method in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, synchronises)
    into: dict[str, torch.Tensor] = {}
    clip_and_accumulate(_gradients(0), C, into)
    clip_and_accumulate(_gradients(1), C, into)
    privatize(into, 1.0, C, RandomSource.seeded_from(0, NOISE), 8.0)


BATCH, LR, SIGMA, SEED, CLIP = 8, 0.5, 0.7, 5, 2.0  # CLIP: 3 of the 8 examples clipped, 5 not


def test_dptrainer_and_make_private_take_the_identical_step():
    """The same weights, batch and seeded noise: one step through each front-end gives the same weights."""
    images, labels = tiny_images()
    chosen = torch.arange(BATCH)  # the batch, with sampling bypassed on both sides
    torch.manual_seed(SEED)
    model = perturbed(linear_classifier())
    sgd = functools.partial(torch.optim.SGD, lr=LR)

    with pytest.warns(UserWarning, match="NOT differentially private"):
        trainer = DPTrainer(
            copy.deepcopy(model), optimizer=sgd, lr=LR, batch_size=BATCH, noise_multiplier=SIGMA,
            target_epsilon=None, max_grad_norm=CLIP, aug_mult=1, augment_padding=0, augment_flip=False,
            per_sample_method="bookkeeping", ema_decay=None, steps=1, seed=SEED, insecure_seeded_noise=True,
            progress=False,
        )  # fmt: skip
    trainer._prepare_privacy(N)
    trainer.sampler.sample = lambda: chosen
    trainer.train_step(images, labels)

    module = copy.deepcopy(model)
    normalized = trainer._normalize(images)  # the trainer's own preprocessing, applied for make_private's user
    loader = DataLoader(TensorDataset(normalized, labels), batch_size=BATCH)
    with pytest.warns(UserWarning, match="NOT differentially private"):
        private, optimizer, _ = make_private(
            module=module, optimizer=sgd(module.parameters()), data_loader=loader, max_grad_norm=CLIP,
            noise_multiplier=SIGMA, debug_seed=SEED,
        )  # fmt: skip
    assert optimizer.expected_batch_size == BATCH
    F.cross_entropy(private(normalized[chosen]), labels[chosen]).backward()
    optimizer.step()

    params = {n: p.detach() for n, p in model.named_parameters()}
    grads, _ = per_sample_gradients(model, params, {}, normalized[chosen].unsqueeze(1), labels[chosen])
    assert int((per_sample_norms(grads) > CLIP).sum()) == 3  # the step clips some examples and keeps others
    assert all(not torch.equal(p.detach(), params[n]) for n, p in module.named_parameters())
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), dict(module.named_parameters())[name].detach()), name
