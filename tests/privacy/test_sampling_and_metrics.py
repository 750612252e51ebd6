"""Poisson sampling, augmentation multiplicity, metrics and EMA of the DP training loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from equiconvert.training.augment import augment_views, augmentation_params
from equiconvert.training.ema import ExponentialMovingAverage
from equiconvert.training.metrics import classification_metrics, evaluate
from equiconvert.privacy.sampling import PoissonSampler, physical_chunks
from equiconvert.privacy.secure_rng import SAMPLING, RandomSource

# ----------------------------------------------------------------------------- Poisson sampling


def _seeded(seed: int) -> RandomSource:
    return RandomSource.seeded_from(seed, SAMPLING)


def test_poisson_batch_size_mean_and_variance() -> None:
    n, expected, draws = 1000, 100, 2000
    sampler = PoissonSampler(n, expected, _seeded(1))
    q = sampler.sample_rate
    assert q == pytest.approx(0.1)
    counts = torch.zeros(n)
    sizes = []
    for _ in range(draws):
        batch = sampler.sample()
        assert batch.dtype == torch.long
        assert batch.unique().numel() == batch.numel()  # no duplicates
        assert batch.numel() == 0 or (batch.min() >= 0 and batch.max() < n)
        counts[batch] += 1
        sizes.append(batch.numel())
    sizes_t = torch.tensor(sizes, dtype=torch.float64)
    var = n * q * (1 - q)
    # Mean of `draws` Binomial(n, q) sizes: standard error sqrt(var / draws).
    assert abs(sizes_t.mean().item() - q * n) < 5 * math.sqrt(var / draws)
    # Sample variance: its standard error is about var * sqrt(2 / (draws - 1)) (near-normal sizes).
    assert abs(sizes_t.var().item() - var) < 5 * var * math.sqrt(2 / (draws - 1))
    # Per-index inclusion frequency ~ Binomial(draws, q) / draws.
    freq = counts / draws
    assert (freq - q).abs().max().item() < 5 * math.sqrt(q * (1 - q) / draws)
    assert abs(freq.mean().item() - q) < 5 * math.sqrt(q * (1 - q) / (draws * n))
    assert sampler.num_batches_drawn == draws


def test_poisson_empty_batches_with_tiny_rate() -> None:
    sampler = PoissonSampler(100, 1, _seeded(0))  # q = 0.01: P(empty) = 0.99^100 ~ 0.37
    batches = [sampler.sample() for _ in range(200)]
    empty = [b for b in batches if b.numel() == 0]
    assert 30 < len(empty) < 120
    for b in empty:
        assert isinstance(b, torch.Tensor) and b.shape == (0,) and b.dtype == torch.long
    assert physical_chunks(empty[0], 8) == []


def test_poisson_full_rate_takes_everything() -> None:
    sampler = PoissonSampler(7, 7, _seeded(0))
    assert torch.equal(sampler.sample(), torch.arange(7))


def test_poisson_state_round_trip_reproduces_future_batches() -> None:
    sampler = PoissonSampler(500, 37, _seeded(123))
    for _ in range(5):
        sampler.sample()
    state = sampler.state_dict()
    expected = [sampler.sample() for _ in range(10)]
    torch.manual_seed(999)  # global RNG must not matter
    resumed = PoissonSampler(500, 37, RandomSource.secret())
    resumed.load_state_dict(state)
    assert resumed.num_batches_drawn == 5
    for want in expected:
        assert torch.equal(resumed.sample(), want)
    # Same seed from scratch gives the same sequence too.
    fresh = PoissonSampler(500, 37, _seeded(123))
    first = [fresh.sample() for _ in range(15)]
    assert all(torch.equal(a, b) for a, b in zip(first[5:], expected))
    with pytest.raises(ValueError):
        PoissonSampler(500, 38, _seeded(123)).load_state_dict(state)


@pytest.mark.parametrize("n, b", [(10, 0), (10, -1), (10, 11), (0, 1)])
def test_poisson_invalid_rate_raises(n: int, b: int) -> None:
    with pytest.raises(ValueError):
        PoissonSampler(n, b, _seeded(0))


def test_physical_chunks() -> None:
    indices = torch.randperm(103)[:23]
    chunks = physical_chunks(indices, 8)
    assert [c.numel() for c in chunks] == [8, 8, 7]
    assert torch.equal(torch.cat(chunks), indices)
    assert [c.numel() for c in physical_chunks(indices, 23)] == [23]
    assert [c.numel() for c in physical_chunks(indices, 100)] == [23]
    assert [c.numel() for c in physical_chunks(indices, 1)] == [1] * 23
    assert physical_chunks(torch.empty(0, dtype=torch.long), 4) == []
    with pytest.raises(ValueError):
        physical_chunks(indices, 0)


# ----------------------------------------------------------------------------- augmentation


def _naive_view(image: torch.Tensor, dy: int, dx: int, flipped: bool, padding: int) -> torch.Tensor:
    """Reference: pad one (C, H, W) image, crop at (dy, dx), maybe flip."""
    h, w = image.shape[-2:]
    padded = (
        F.pad(image[None].to(torch.float64), (padding,) * 4, mode="reflect")[0] if padding else image.to(torch.float64)
    )
    crop = padded[:, dy : dy + h, dx : dx + w]
    return (crop.flip(-1) if flipped else crop).to(image.dtype)


def test_augment_shape_and_view_zero() -> None:
    images = torch.randn(5, 3, 12, 10, dtype=torch.float64)
    views = augment_views(images, 4, torch.Generator().manual_seed(0))
    assert views.shape == (5, 4, 3, 12, 10)
    assert views.dtype == images.dtype
    assert torch.equal(views[:, 0], images)
    single = augment_views(images, 1, None)
    assert single.shape == (5, 1, 3, 12, 10) and torch.equal(single[:, 0], images)


def test_augment_without_padding_or_flip_is_identity() -> None:
    images = torch.randn(4, 2, 8, 8)
    views = augment_views(images, 5, torch.Generator().manual_seed(3), padding=0, flip=False)
    assert torch.equal(views, images[:, None].expand(-1, 5, -1, -1, -1))


@pytest.mark.parametrize("padding", [1, 3])  # 1: the crops of the Fashion-MNIST recipe (README)
@pytest.mark.parametrize("dtype", [torch.float64, torch.uint8])
def test_augment_matches_naive_loop(dtype: torch.dtype, padding: int) -> None:
    batch, k, c, h, w, p = 6, 5, 3, 9, 7, padding
    if dtype == torch.uint8:
        images = torch.randint(0, 256, (batch, c, h, w), dtype=torch.uint8)
    else:
        images = torch.randn(batch, c, h, w, dtype=dtype)
    views = augment_views(images, k, torch.Generator().manual_seed(42), padding=p)
    assert views.dtype == dtype and views.shape == (batch, k, c, h, w)
    # Same generator state -> same parameters (augment_views draws them with augmentation_params).
    oy, ox, fl = augmentation_params(batch, k - 1, p, True, torch.Generator().manual_seed(42), "cpu")
    assert oy.min() >= 0 and oy.max() <= 2 * p and ox.min() >= 0 and ox.max() <= 2 * p
    for i in range(batch):
        assert torch.equal(views[i, 0], images[i])
        for v in range(1, k):
            want = _naive_view(images[i], int(oy[i, v - 1]), int(ox[i, v - 1]), bool(fl[i, v - 1]), p)
            assert torch.equal(views[i, v], want)


def test_augment_views_are_some_padded_crop_and_vary() -> None:
    """Implementation-independent: each view equals one of the (2p+1)^2 * 2 candidate crops of its own image."""
    batch, k, p = 16, 4, 2
    images = torch.randn(batch, 3, 8, 8, dtype=torch.float64)  # continuous values: candidates are distinct
    views = augment_views(images, k, torch.Generator().manual_seed(5), padding=p)
    chosen = set()
    flips = 0
    for i in range(batch):
        candidates = {
            (dy, dx, f): _naive_view(images[i], dy, dx, f, p)
            for dy in range(2 * p + 1)
            for dx in range(2 * p + 1)
            for f in (False, True)
        }
        for v in range(1, k):
            matches = [key for key, cand in candidates.items() if torch.equal(views[i, v], cand)]
            assert len(matches) == 1, (i, v, matches)
            chosen.add(matches[0][:2])
            flips += matches[0][2]
    total = batch * (k - 1)
    assert len(chosen) > 10  # offsets differ across samples/views, not one crop for everyone
    assert 0.2 * total < flips < 0.8 * total  # p = 0.5 flips (48 draws)


def test_augment_uses_generator_and_rejects_bad_args() -> None:
    images = torch.randn(3, 1, 6, 6)
    a = augment_views(images, 3, torch.Generator().manual_seed(1))
    b = augment_views(images, 3, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        augment_views(images, 0, None)
    with pytest.raises(ValueError):
        augment_views(images, 2, None, padding=6)  # reflect padding must be < size
    with pytest.raises(ValueError):
        augment_views(images[0], 2, None)


# ----------------------------------------------------------------------------- metrics


def test_metrics_perfect_predictions() -> None:
    labels = torch.tensor([0, 2, 1, 3, 2])
    logits = 100.0 * F.one_hot(labels, 4).float()
    m = classification_metrics(logits, labels)
    assert m["accuracy"] == 1.0
    assert m["brier"] == pytest.approx(0.0, abs=1e-12)
    assert m["ece"] == pytest.approx(0.0, abs=1e-12)
    assert m["loss"] == pytest.approx(0.0, abs=1e-12)


def test_metrics_uniform_logits() -> None:
    c = 10
    labels = torch.arange(20) % c
    m = classification_metrics(torch.zeros(20, c), labels)
    assert m["brier"] == pytest.approx(1 - 1 / c)
    assert m["loss"] == pytest.approx(math.log(c))
    # Confidence 1/c everywhere; argmax picks class 0, right for 2 of 20 samples.
    assert m["accuracy"] == pytest.approx(0.1)
    assert m["ece"] == pytest.approx(abs(0.1 - 1 / c), abs=1e-12)


def test_metrics_hand_made_ece_and_brier() -> None:
    # Binary problem, probabilities given directly (logits = log p).
    probs = torch.tensor(
        [
            [0.95, 0.05],  # conf 0.95, correct  -> bin (0.9, 1.0]
            [0.95, 0.05],  # conf 0.95, wrong    -> bin (0.9, 1.0]
            [0.35, 0.65],  # conf 0.65, correct  -> bin (0.6, 0.7]
            [0.70, 0.30],  # conf 0.70, correct  -> bin (0.6, 0.7] (upper edge inclusive)
            [0.45, 0.55],  # conf 0.55, wrong    -> bin (0.5, 0.6]
        ],
        dtype=torch.float64,
    )
    labels = torch.tensor([0, 1, 1, 0, 0])
    m = classification_metrics(probs.log(), labels, num_bins=10)
    # Bins: {0.95, 0.95}: acc 0.5, conf 0.95 -> 2/5 * 0.45
    #       {0.65, 0.70}: acc 1.0, conf 0.675 -> 2/5 * 0.325 (0.70 may round into the next bin: same sum)
    #       {0.55}:       acc 0.0, conf 0.55 -> 1/5 * 0.55
    assert m["ece"] == pytest.approx(0.4 * 0.45 + 0.4 * 0.325 + 0.2 * 0.55)
    assert m["accuracy"] == pytest.approx(3 / 5)
    brier_rows = [2 * 0.05**2, 2 * 0.95**2, 2 * 0.35**2, 2 * 0.30**2, 2 * 0.55**2]
    assert m["brier"] == pytest.approx(sum(brier_rows) / 5)
    nll = -sum(math.log(p) for p in [0.95, 0.05, 0.65, 0.70, 0.45]) / 5
    assert m["loss"] == pytest.approx(nll)


def test_evaluate_batches_and_restores_mode() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5))
    model.train()
    images = torch.randint(0, 256, (13, 3, 4, 4), dtype=torch.uint8)
    labels = torch.randint(0, 5, (13,))
    seen: list[torch.dtype] = []

    def normalize(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.dtype)
        assert 0.0 <= x.min() and x.max() <= 1.0
        return (x - 0.5) / 0.25

    m = evaluate(model, images, labels, batch_size=4, device="cpu", normalize=normalize)
    assert model.training
    assert len(seen) == 4 and all(d == torch.float32 for d in seen)
    with torch.no_grad():
        want = classification_metrics(model((images.float() / 255 - 0.5) / 0.25), labels)
    for key in ("accuracy", "loss", "brier", "ece"):
        assert m[key] == pytest.approx(want[key], abs=1e-6)


# ----------------------------------------------------------------------------- EMA


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def test_ema_warmup_formula() -> None:
    ema = ExponentialMovingAverage(_model(), decay=0.999)
    assert ema.decay_at(0) == pytest.approx(0.1)
    assert ema.decay_at(10) == pytest.approx(11 / 20)
    assert ema.decay_at(1000) == pytest.approx(1001 / 1010)
    assert ema.decay_at(10**6) == pytest.approx(0.999)
    # One update at step 0: ema = 0.1 * old + 0.9 * new.
    model = _model()
    ema = ExponentialMovingAverage(model, decay=0.999)
    old = {k: v.clone() for k, v in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model, step=0)
    for name, p in model.named_parameters():
        assert torch.allclose(ema.params[name], 0.1 * old[name] + 0.9 * p)
    ema.update(model, step=10)
    for name, p in model.named_parameters():
        assert torch.allclose(ema.params[name], 0.55 * (0.1 * old[name] + 0.9 * p) + 0.45 * p)


def test_an_ema_decay_the_warmup_never_reaches_is_named_and_trains_the_same_ema() -> None:
    # 0.995 is passed at step 1,790 (< 4,000); 0.998 and 0.999 are not (the cap at step 3,999 is 4000/4009)
    assert ExponentialMovingAverage(_model(), decay=0.995).unreached_warning(4000) is None
    message = ExponentialMovingAverage(_model(), decay=0.999).unreached_warning(4000)
    assert message is not None and "0.999" in message and "8990 steps" in message and f"{4000 / 4009:.4f}" in message
    assert ExponentialMovingAverage(_model(), decay=0.999).unreached_warning(9000) is None
    model, steps = _model(), 4000
    shadows = [ExponentialMovingAverage(model, decay=d) for d in (0.998, 0.999)]
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=generator))
        for ema in shadows:
            ema.update(model, step)
    for name in shadows[0].params:
        assert torch.equal(shadows[0].params[name], shadows[1].params[name])


def test_the_trainer_warns_when_its_ema_decay_is_never_reached() -> None:
    from equiconvert.training import DPTrainer

    with pytest.warns(UserWarning, match="EMA decay 0.999 is never reached in 300 steps"):
        DPTrainer(
            nn.Sequential(nn.Flatten(), nn.Linear(4, 2)),
            device="cpu",
            steps=300,
            ema_decay=0.999,
            noise_multiplier=1.0,
            progress=False,
        )


def test_ema_converges_to_constant_params_and_copies_buffers() -> None:
    model = _model()
    ema = ExponentialMovingAverage(model, decay=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        model[1].running_mean.fill_(3.0)
    for step in range(400):
        ema.update(model, step)
    for name, p in model.named_parameters():
        assert torch.allclose(ema.params[name], p, atol=1e-6)
    assert torch.equal(ema.buffers["1.running_mean"], model[1].running_mean)
    assert ema.num_updates == 400


def test_ema_applied_restores_weights() -> None:
    model = _model()
    ema = ExponentialMovingAverage(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(5.0)
        model[1].running_var.fill_(7.0)
    training = {k: v.clone() for k, v in model.state_dict().items()}
    param_ids = [id(p) for p in model.parameters()]
    x = torch.randn(6, 3)
    model.eval()
    with ema.applied(model):
        for name, p in model.named_parameters():
            assert torch.equal(p, ema.params[name])
        assert torch.equal(model[1].running_var, ema.buffers["1.running_var"])
        out_ema = model(x)
    for k, v in model.state_dict().items():
        assert torch.equal(v, training[k])
    assert [id(p) for p in model.parameters()] == param_ids  # in place: torch.func references stay valid
    assert not torch.allclose(out_ema, model(x))
    with pytest.raises(RuntimeError), ema.applied(model):
        raise RuntimeError("boom")
    for k, v in model.state_dict().items():
        assert torch.equal(v, training[k])
    ema.copy_to(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, ema.params[name])


def test_ema_with_functional_params_dict() -> None:
    model = _model()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ema = ExponentialMovingAverage(params, decay=0.5)
    for tensor in params.values():
        tensor.add_(2.0)  # an in-place optimizer step on the torch.func params
    ema.update(params, step=10**6)
    for name, tensor in params.items():
        assert torch.allclose(ema.params[name], tensor - 1.0)
    with ema.applied(params):
        assert all(torch.allclose(params[k], ema.params[k]) for k in params)
    ema2 = ExponentialMovingAverage(model)
    with pytest.raises(KeyError):
        ema2.update({"nope": torch.zeros(1)}, step=0)


def test_ema_state_round_trip() -> None:
    model = _model()
    ema = ExponentialMovingAverage(model, decay=0.99)
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model, step)
    state = ema.state_dict()
    restored = ExponentialMovingAverage(_model(), decay=0.5)
    restored.load_state_dict(state)
    assert restored.decay == 0.99 and restored.num_updates == 3
    for name in ema.params:
        assert torch.equal(restored.params[name], ema.params[name])
    for name in ema.buffers:
        assert torch.equal(restored.buffers[name], ema.buffers[name])
    # state is a snapshot: later updates don't change it, and both continue identically.
    ema.update(model, 3)
    restored.update(model, 3)
    for name in ema.params:
        assert torch.equal(restored.params[name], ema.params[name])
        assert not torch.equal(state["params"][name], ema.params[name])


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_everything_runs_on_cuda() -> None:
    device = torch.device("cuda")
    images = torch.randint(0, 256, (8, 3, 10, 10), dtype=torch.uint8, device=device)
    views = augment_views(images, 4, torch.Generator(device=device).manual_seed(0), padding=2)
    assert views.device.type == "cuda" and views.shape == (8, 4, 3, 10, 10)
    assert torch.equal(views[:, 0], images)
    assert augment_views(images.double(), 3, None).device.type == "cuda"
    with pytest.raises(ValueError):
        augment_views(images, 2, torch.Generator())  # CPU generator, CUDA data
    # Same parameters as the CPU path once the draws are moved over.
    oy, ox, fl = augmentation_params(8, 3, 2, True, torch.Generator(device=device).manual_seed(0), device)
    for i in range(8):
        for v in range(1, 4):
            want = _naive_view(images[i].cpu(), int(oy[i, v - 1]), int(ox[i, v - 1]), bool(fl[i, v - 1]), 2)
            assert torch.equal(views[i, v].cpu(), want)
    labels = torch.randint(0, 5, (50,), device=device)
    logits = torch.randn(50, 5, device=device)
    on_gpu = classification_metrics(logits, labels)
    on_cpu = classification_metrics(logits.cpu(), labels.cpu())
    for key in on_cpu:
        assert on_gpu[key] == pytest.approx(on_cpu[key], abs=1e-9)
    model = _model().to(device)
    m = evaluate(model, images.flatten(1)[:, :3].cpu(), labels[:8].cpu().clamp(max=1), 3, device, None)
    assert 0.0 <= m["accuracy"] <= 1.0
    ema = ExponentialMovingAverage(model)
    ema.update(model, 0)
    state = ema.state_dict()
    cpu_state = {
        **state,
        "params": {k: v.cpu() for k, v in state["params"].items()},
        "buffers": {k: v.cpu() for k, v in state["buffers"].items()},
    }
    ema.load_state_dict(cpu_state)  # checkpoints load on CPU
    assert all(t.device.type == "cuda" for t in ema.params.values())
    with ema.applied(model):
        pass
