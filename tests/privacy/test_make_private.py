"""make_private: Opacus' per-example gradients and epsilon, Poisson batches, physical batching, noise, non-finite
examples, refusals."""

import copy
import math
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus import PrivacyEngine as OpacusEngine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import equiconvert
import equiconvert.privacy.opacus_interop  # noqa: F401  (Opacus' samplers for the steerable layers)
from equiconvert.privacy import BatchMemoryManager, PrivacyEngine, make_private
from equiconvert.privacy.accounting import PrivacyBudgetError
from equiconvert.privacy.bookkeeping import BookkeepingUnsupportedError
from equiconvert.privacy.dp_optimizer import OptimizerCopyError
from equiconvert.privacy.validate import PrivacyValidationError


class PlainCNN(nn.Module):
    """The standard layers of a plain CNN: Conv2d, GroupNorm, LayerNorm, Linear."""

    def __init__(self, layer_norm: bool = True):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.norm2 = nn.LayerNorm(8) if layer_norm else nn.Identity()  # the converter has no LayerNorm rule
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.conv2(x)).mean((2, 3))
        return self.head(self.norm2(x))


class EmbeddingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(12, 6, padding_idx=0)
        self.head = nn.Linear(6, 10)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(1))


def _perturbed(model: nn.Module) -> nn.Module:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))  # non-trivial norm affines
    return model.train()


def converted_model() -> nn.Module:
    return _perturbed(equiconvert.make_equivariant(PlainCNN(layer_norm=False), "C4", head="invariant"))


MODELS = {"converted C4": converted_model, "plain CNN": lambda: _perturbed(PlainCNN())}


def _private(model, data, batch_size=4, **options):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "debug_seed": 0, **options}
    with pytest.warns(UserWarning, match="NOT differentially private"):
        return make_private(
            module=model, optimizer=optimizer, data_loader=DataLoader(data, batch_size=batch_size), **options
        )


def _ours(model, x, y, aug_mult=1):
    data = TensorDataset(x, y)
    private, _, _ = _private(model, data, aug_mult=aug_mult)
    targets = y.repeat_interleave(aug_mult)
    F.cross_entropy(private(x), targets).backward()
    grads = private.per_sample_gradients()
    return {name: grads[p] for name, p in model.named_parameters()}


def _naive(model, x, y):
    """Each example's gradient of its loss (the mean over its views when x is (B, K, ...)), one example at a time."""
    out = {name: [] for name, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        views = x[i] if x.dim() == 5 else x[i : i + 1]
        loss = F.cross_entropy(model(views), y[i : i + 1].expand(views.shape[0]))
        for (name, _), g in zip(model.named_parameters(), torch.autograd.grad(loss, list(model.parameters()))):
            out[name].append(g)
    return {name: torch.stack(gs) for name, gs in out.items()}


def _assert_close(got, expected, tolerance=1e-5):
    assert got.keys() == expected.keys()
    for name in expected:
        scale = expected[name].abs().max().clamp_min(1e-12)
        error = float((got[name] - expected[name]).abs().max() / scale)
        assert error <= tolerance, (name, error)


@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_gradients_equal_opacus_and_a_naive_loop(name):
    model = MODELS[name]()
    x, y = torch.randn(5, 3, 9, 9), torch.randint(0, 10, (5,))
    ours = _ours(copy.deepcopy(model), x, y)
    _assert_close(ours, _naive(copy.deepcopy(model), x, y))
    reference = copy.deepcopy(model)
    opacus = GradSampleModule(reference)
    F.cross_entropy(opacus(x), y).backward()
    _assert_close(ours, {n: p.grad_sample for n, p in reference.named_parameters()})


@pytest.mark.parametrize("name", list(MODELS))
def test_views_are_averaged_before_clipping(name):
    model = MODELS[name]()
    x, y = torch.randn(4, 3, 3, 9, 9), torch.randint(0, 10, (4,))
    _assert_close(_ours(copy.deepcopy(model), x, y, aug_mult=3), _naive(copy.deepcopy(model), x, y))


def test_in_place_activations_after_the_first_layer_are_allowed():
    model = _perturbed(
        nn.Sequential(
            nn.Conv2d(3, 4, 3),
            nn.ReLU(inplace=True),
            nn.Conv2d(4, 4, 3),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4, 10),
        )
    )
    x, y = torch.randn(4, 3, 9, 9), torch.randint(0, 10, (4,))
    _assert_close(_ours(copy.deepcopy(model), x, y), _naive(copy.deepcopy(model), x, y))


class InputChangedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        h = self.first(x)
        out = self.second(h)
        h.mul_(2)  # after `second` read it: its kept input is no longer what it saw
        return out + h.sum(1, keepdim=True)


def test_a_layer_input_changed_in_place_afterwards_is_refused():
    model = InputChangedInPlace()
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    private, optimizer, _ = _private(model, TensorDataset(x, y), verify=False)
    F.cross_entropy(private(x), y).backward()
    with pytest.raises(RuntimeError, match=r"inputs of layers \['second'\] were modified in place"):
        optimizer.step()


def test_embedding_per_sample_gradients_equal_a_naive_loop():
    model = _perturbed(EmbeddingNet())
    tokens, y = torch.randint(0, 12, (6, 5)), torch.randint(0, 10, (6,))
    tokens[0, :2] = 0  # the padding row gets no gradient
    with pytest.warns(UserWarning, match="non-float inputs"):
        ours = _ours(copy.deepcopy(model), tokens, y)
    _assert_close(ours, _naive(copy.deepcopy(model), tokens, y))


def _epsilon_after_steps(engine, model, data, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    private, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=0.8,
        max_grad_norm=1.0,
    )
    for x, y in list(loader)[:steps]:
        optimizer.zero_grad()
        F.cross_entropy(private(x), y).backward()
        optimizer.step()
    return engine.get_epsilon(1e-5)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_epsilon_equals_opacus_for_the_same_settings(accountant):
    data = TensorDataset(torch.randn(16, 3, 9, 9), torch.randint(0, 10, (16,)))
    ours = _epsilon_after_steps(PrivacyEngine(accountant=accountant), PlainCNN(), data, 3)
    theirs = _epsilon_after_steps(OpacusEngine(accountant=accountant), PlainCNN(), data, 3)
    assert ours > 0
    assert ours == pytest.approx(theirs, rel=1e-9)


def test_poisson_loader_inclusion_statistics():
    n, batch, epochs = 200, 20, 40
    data = TensorDataset(torch.arange(n))
    model = nn.Linear(1, 1)
    with pytest.warns(UserWarning, match="NOT differentially private"):
        _, _, loader = make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=batch),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            debug_seed=3,
        )
    assert len(loader) == n // batch and loader.sample_rate == pytest.approx(batch / n)
    masks = torch.zeros(epochs * len(loader), n)
    for row, (indices,) in enumerate(b for _ in range(epochs) for b in loader):
        masks[row, indices] = 1
    q, trials = batch / n, masks.numel()
    assert abs(float(masks.mean()) - q) < 4 * math.sqrt(q * (1 - q) / trials)  # each example joins w.p. q
    sizes = masks.sum(1)
    assert abs(float(sizes.mean()) - batch) < 4 * math.sqrt(n * q * (1 - q) / len(sizes))
    assert float(sizes.var()) == pytest.approx(n * q * (1 - q), rel=0.25)  # binomial, not a fixed size
    both = (masks[:, :100] * masks[:, 100:]).mean()  # two examples join independently
    assert abs(float(both) - q * q) < 4 * math.sqrt(q * q / (masks.shape[0] * 100))
    per_example = masks.mean(0)  # no example is favoured
    assert float(per_example.max() - per_example.min()) < 8 * math.sqrt(q * (1 - q) / masks.shape[0])


def test_an_empty_poisson_batch_keeps_its_shape_and_still_steps():
    model = PlainCNN()
    data = TensorDataset(torch.randn(3, 3, 9, 9), torch.randint(0, 10, (3,)))
    private, optimizer, loader = _private(model, data, batch_size=1)
    loader.batch_sampler.sample_rate = 1e-12  # every batch empty
    ((x, y),) = list(loader)[:1]
    assert x.shape == (0, 3, 9, 9) and y.shape == (0,) and y.dtype == torch.int64
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    private(x).sum().backward()
    optimizer.step()  # noise only: the step is taken and accounted
    assert optimizer.steps == 1
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _train(model, data, physical=None, steps=2):
    private, optimizer, loader = _private(model, data, batch_size=4)
    batches = (
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer)
        if physical
        else None
    )
    with batches if batches else _nullcontext(loader) as iterator:
        for x, y in iterator:
            optimizer.zero_grad()
            F.cross_entropy(private(x), y).backward()
            optimizer.step()
            if optimizer.steps == steps:
                break
    return model, optimizer


class _nullcontext:
    def __init__(self, value):
        self.value = value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return None


def test_physical_batching_equals_one_big_batch():
    data = TensorDataset(torch.randn(24, 3, 9, 9), torch.randint(0, 10, (24,)))
    start = _perturbed(PlainCNN())
    whole, whole_opt = _train(copy.deepcopy(start), data)  # same debug seed: same batches, same noise
    chunked, chunked_opt = _train(copy.deepcopy(start), data, physical=2)
    assert whole_opt.steps == chunked_opt.steps == 2
    for a, b in zip(whole.parameters(), chunked.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), whole.parameters()))


def test_frozen_parameters_are_untouched():
    model = _perturbed(PlainCNN())
    model.conv1.requires_grad_(False)
    model.norm1.weight.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    data = TensorDataset(torch.randn(16, 3, 9, 9), torch.randint(0, 10, (16,)))
    model, _ = _train(model, data)
    params = dict(model.named_parameters())
    for name, value in frozen.items():
        assert torch.equal(params[name], value) and params[name].grad is None, name
    assert all(not torch.equal(params[n], v) for n, v in trained.items())


def test_noise_has_the_calibrated_standard_deviation():
    model = nn.Linear(60, 50)
    data = TensorDataset(torch.randn(40, 60), torch.randint(0, 50, (40,)))
    private, optimizer, loader = _private(model, data, batch_size=8, noise_multiplier=1.3, max_grad_norm=0.7)
    x, _ = next(iter(loader))
    draws = []
    for _ in range(4):
        optimizer.zero_grad()
        (private(x) * 0).sum().backward()  # every per-example gradient is 0: .grad is the noise alone
        optimizer.step()
        draws.append(torch.cat([model.weight.grad.flatten(), model.bias.grad]))
    noise = torch.cat(draws) * loader.expected_batch_size  # divided by the expected batch size (mean loss)
    std = 1.3 * 0.7
    assert loader.expected_batch_size == pytest.approx(8)
    assert abs(float(noise.mean())) < 4 * std / math.sqrt(noise.numel())
    assert float(noise.std()) == pytest.approx(std, rel=4 * math.sqrt(0.5 / noise.numel()))
    assert abs(float(torch.corrcoef(torch.stack(draws[:2]))[0, 1])) < 4 / math.sqrt(draws[0].numel())


def test_clipping_bounds_each_example():
    model = _perturbed(PlainCNN())
    x, y = torch.randn(6, 3, 9, 9) * 50, torch.randint(0, 10, (6,))
    private, optimizer, _ = _private(model, TensorDataset(x, y), max_grad_norm=0.01)
    F.cross_entropy(private(x), y).backward()
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in private.per_sample_gradients().values()]).norm(dim=0)
    assert bool((norms > 0.01).all())  # clipping is needed
    optimizer._accumulate()
    total = torch.cat([s.flatten() for s in optimizer._summed.values()]).norm()
    assert float(total) <= 6 * 0.01 * (1 + 1e-5)


def _steps_on(start, data, batches):
    """A copy of `start` after one make_private step on each (x, y) of `batches` (debug seed 0: the same noise)."""
    model = copy.deepcopy(start)
    private, optimizer, _ = _private(model, data)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(private(x), y).backward()
        optimizer.step()
    return model, optimizer


def test_a_non_finite_example_counts_as_zero_and_is_counted():
    x, y = torch.randn(6, 3, 9, 9), torch.randint(0, 10, (6,))
    corrupt = x.clone()
    corrupt[2, 1, 4, 4] = float("inf")  # a corrupt record in the user's loader
    start, data = _perturbed(PlainCNN()), TensorDataset(x, y)

    probe, _, _ = _private(copy.deepcopy(start), data)
    F.cross_entropy(probe(corrupt), y).backward()
    finite = torch.stack([g.flatten(1).isfinite().all(1) for g in probe.per_sample_gradients().values()]).all(0)
    assert finite.tolist() == [True, True, False, True, True, True]  # example 2's gradient is NaN, the others not

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the count is a noise-free statistic: never announced
        with_corrupt, optimizer = _steps_on(start, data, [(corrupt, y)])
    keep = [0, 1, 3, 4, 5]
    without, clean = _steps_on(start, data, [(x[keep], y[keep])])
    assert optimizer.nonfinite_gradients == 1 and clean.nonfinite_gradients == 0
    for name, p in with_corrupt.named_parameters():
        assert bool(p.isfinite().all()), name
        torch.testing.assert_close(p, dict(without.named_parameters())[name], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), with_corrupt.parameters()))


def test_non_finite_examples_accumulate_silently():
    x, y = torch.randn(4, 3, 9, 9), torch.randint(0, 10, (4,))
    x[0, 0, 0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, optimizer = _steps_on(_perturbed(PlainCNN()), TensorDataset(x, y), [(x, y), (x, y)])
    assert optimizer.nonfinite_gradients == 2 and optimizer.steps == 2
    assert all(bool(p.isfinite().all()) for p in model.parameters())


def test_randomness_is_secret_unless_a_debug_seed_is_given():
    data = TensorDataset(torch.arange(400))
    loaders = []
    for _ in range(2):
        model = nn.Linear(1, 1)
        _, optimizer, loader = make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=40),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
        assert optimizer.private
        loaders.append([b[0].tolist() for b in loader])
    assert loaders[0] != loaders[1]
    seeded = [
        [b[0].tolist() for b in _private(nn.Linear(1, 1), data, batch_size=40, debug_seed=5)[2]] for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


def test_target_delta_of_one_over_n_or_more_is_refused_and_a_weak_one_warned_about():
    data = TensorDataset(torch.randn(16, 3, 9, 9), torch.randint(0, 10, (16,)))

    def private(delta: float):
        model = PlainCNN()
        return make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=4),
            max_grad_norm=1.0,
            target_epsilon=3.0,
            target_delta=delta,
            steps=4,
        )

    with pytest.raises(PrivacyBudgetError, match=r"target_delta=0.1 >= 1/N = 1/16"):
        private(0.1)
    with pytest.warns(UserWarning, match=r"delta 0.01 > 1/\(10 N\).*weak guarantee for 16 examples"):
        private(0.01)


def test_target_epsilon_is_calibrated_and_enforced():
    model = PlainCNN()
    data = TensorDataset(torch.randn(16, 3, 9, 9), torch.randint(0, 10, (16,)))
    private, optimizer, loader = _private(
        model, data, noise_multiplier=None, target_epsilon=3.0, target_delta=1e-5, steps=4, accountant="rdp"
    )
    x, y = next(iter(loader))
    for _ in range(4):
        optimizer.zero_grad()
        F.cross_entropy(private(x), y).backward()
        optimizer.step()
    assert 2.9 <= optimizer.get_epsilon(1e-5) <= 3.0
    optimizer.zero_grad()
    F.cross_entropy(private(x), y).backward()
    with pytest.raises(PrivacyBudgetError, match="target_epsilon=3.0"):
        optimizer.step()


class SharedWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize(
    "model, error, match",
    [
        (
            lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)),
            PrivacyValidationError,
            r"1 \(torch.nn.modules.batchnorm.BatchNorm2d\): batch norm",
        ),
        (SharedWeights, BookkeepingUnsupportedError, "shared by layers 'a' and 'b'"),
    ],
)
def test_unsupported_models_are_refused_by_name(model, error, match):
    model = model()
    with pytest.raises(error, match=match):
        make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(torch.randn(4, 3, 8, 8)), batch_size=2),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )


def test_bad_inputs_fail_early_and_say_what_to_do():
    model, other = PlainCNN(), nn.Linear(2, 2)
    data = TensorDataset(torch.randn(8, 3, 9, 9), torch.randint(0, 10, (8,)))
    with pytest.raises(ValueError, match="not the module's"):
        make_private(
            module=model,
            optimizer=torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1),
            data_loader=DataLoader(data, batch_size=2),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    with pytest.raises(ValueError, match="not both"):
        make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=2),
            noise_multiplier=1.0,
            target_epsilon=1.0,
            max_grad_norm=1.0,
        )
    private, _, _ = _private(model, data, aug_mult=2)
    with pytest.raises(ValueError, match=r"\(B, 2, ...\)"):
        private(torch.randn(2, 3, 9, 9))


def test_any_torch_optimizer_and_its_lr_scheduler_run_under_make_private():
    model = _perturbed(PlainCNN())
    data = TensorDataset(torch.randn(12, 3, 9, 9), torch.randint(0, 10, (12,)))
    with pytest.warns(UserWarning, match="NOT differentially private"):
        private, optimizer, loader = make_private(
            module=model,
            optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
            data_loader=DataLoader(data, 4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            debug_seed=1,
        )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(private(x), y).backward()
        optimizer.step()
        scheduler.step()
    assert optimizer.steps == 3 and optimizer.param_groups[0]["lr"] == pytest.approx(0.01 / 8)
    assert len(optimizer.original_optimizer.state) == len(list(model.parameters()))  # Adam's moments exist


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield torch.zeros(3, 9, 9), 0


@pytest.mark.parametrize(
    "loader, options, message",
    [
        (DataLoader(_Stream(), batch_size=2), {}, r"map-style dataset .*_Stream"),
        (DataLoader(TensorDataset(torch.zeros(0, 3, 9, 9), torch.zeros(0)), batch_size=2), {}, r"dataset is empty"),
        (DataLoader(TensorDataset(torch.zeros(4, 3, 9, 9), torch.zeros(4)), batch_size=None), {}, r"batch_size=None"),
        (DataLoader(TensorDataset(torch.zeros(4, 3, 9, 9)), batch_size=2), {"max_grad_norm": float("inf")}, "finite"),
        (
            DataLoader(TensorDataset(torch.zeros(4, 3, 9, 9)), batch_size=2),
            {"noise_multiplier": float("inf")},
            "finite",
        ),
    ],
)
def test_loaders_and_values_poisson_sampling_cannot_use_are_refused_first(loader, options, message):
    model = PlainCNN()
    with pytest.raises(ValueError, match=message):
        make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            **{"noise_multiplier": 1.0, "max_grad_norm": 1.0, **options},
        )


@pytest.mark.parametrize(
    "duplicate",
    [copy.copy, copy.deepcopy, lambda optimizer: pickle.loads(pickle.dumps(optimizer))],
    ids=["copy", "deepcopy", "pickle"],
)
def test_the_private_optimizer_refuses_to_be_copied_saying_why(duplicate):
    """copy.deepcopy used to fail with an AttributeError deep in torch's Optimizer.__setstate__; pickle.dumps
    succeeded and pickle.loads failed the same way."""
    data = TensorDataset(torch.randn(8, 3, 9, 9), torch.randint(0, 10, (8,)))
    _, optimizer, _ = _private(PlainCNN(), data)
    with pytest.raises(
        OptimizerCopyError, match=r"cannot be copied or pickled: a copy would draw the same secret noise"
    ):
        duplicate(optimizer)
    assert isinstance(optimizer.state_dict(), dict)  # what to save instead
