"""check_dp_safe: buffers that forward changes and batch mixing are refused by behaviour, naming the module."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from equiconvert.privacy import check_dp_safe
from equiconvert.training.trainer import DPTrainer
from equiconvert.privacy.validate import PrivacyValidationError, validate_dp_safe

EXAMPLE = torch.zeros(2, 2, 6, 6)


class RenamedRunningAverage(nn.Module):
    """Batch statistics under a name the name-based check does not know."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("seen_average", torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen_average.mul_(0.9).add_(0.1 * x.detach().mean((0, 2, 3)))
        return x


class MeanCentred(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0)


class FunctionalBatchNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, None, None, training=True)


def _model(middle: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.GroupNorm(1, 3), middle, nn.Flatten(), nn.Linear(3 * 16, 4))


def test_buffer_changed_by_forward_is_refused_whatever_its_name():
    model = _model(RenamedRunningAverage(3))
    validate_dp_safe(model)  # the name-based check alone lets it through
    with pytest.raises(PrivacyValidationError, match=r"module '2' changes its buffer 'seen_average'"):
        check_dp_safe(model, EXAMPLE)
    assert torch.equal(model[2].seen_average, torch.zeros(3))  # the probe ran on a copy


@pytest.mark.parametrize("mixer", [MeanCentred, FunctionalBatchNorm], ids=["x-mean0", "F.batch_norm"])
def test_batch_mixing_is_refused_naming_the_first_module_that_mixes(mixer):
    model = _model(mixer())
    with pytest.raises(PrivacyValidationError, match=r"module '2' mixes examples"):
        check_dp_safe(model, EXAMPLE)


def test_timm_batch_norm_act_is_refused_by_name():
    timm_norm = pytest.importorskip("timm.layers")
    model = _model(timm_norm.BatchNormAct2d(3))
    with pytest.raises(PrivacyValidationError, match=r"2 \(timm\.layers\.norm_act\.BatchNormAct2d\)"):
        check_dp_safe(model, EXAMPLE)


def test_safe_model_passes_and_the_trainer_probes_before_training():
    check_dp_safe(_model(nn.ReLU()), EXAMPLE)
    images, labels = torch.rand(16, 2, 6, 6), torch.arange(16) % 4
    trainer = DPTrainer(
        _model(MeanCentred()),
        noise_multiplier=1.0,
        target_epsilon=None,
        batch_size=4,
        steps=1,
        aug_mult=1,
        augment_padding=0,
        progress=False,
        ema_decay=None,
    )
    with pytest.raises(PrivacyValidationError, match="mixes examples"):
        trainer.fit((images, labels))
    assert trainer.step == 0


def test_opacus_make_private_checks_the_model_first():
    pytest.importorskip("opacus")
    timm_norm = pytest.importorskip("timm.layers")
    from opacus import PrivacyEngine

    from equiconvert.privacy.opacus_interop import make_private

    data = torch.utils.data.TensorDataset(torch.rand(8, 2, 6, 6), torch.arange(8) % 4)
    loader = torch.utils.data.DataLoader(data, batch_size=4)

    def private(model: nn.Module):
        return make_private(
            PrivacyEngine(),
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )

    with pytest.raises(PrivacyValidationError, match="BatchNormAct2d"):
        private(_model(timm_norm.BatchNormAct2d(3)))
    with pytest.raises(PrivacyValidationError, match="changes its buffer 'seen_average'"):
        private(_model(RenamedRunningAverage(3)))
    with pytest.warns(UserWarning, match=r"secure_mode=False.*recompute the noise.*secure_mode=True"):
        module, _, _ = private(_model(nn.ReLU()))
    assert module(torch.rand(2, 2, 6, 6)).shape == (2, 4)


class _RecordingEngine:
    """Stands in for an Opacus PrivacyEngine with secure_mode on (which needs torchcsprng): records the call."""

    secure_mode = True

    def make_private(self, **kwargs):
        self.called_with = kwargs
        return kwargs["module"], kwargs["optimizer"], kwargs["data_loader"]


class _InputRecorder(nn.Module):
    seen: list[torch.Tensor] = []  # on the class: shared by the deep copies the checks run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.detach().clone())
        return x


def test_opacus_make_private_checks_the_model_on_random_inputs_and_is_quiet_in_secure_mode(recwarn):
    pytest.importorskip("opacus")
    from equiconvert.privacy.opacus_interop import make_private

    images = torch.full((8, 2, 6, 6), 0.25)  # the training data: every value 0.25 (float32)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, torch.arange(8) % 4), batch_size=4)
    recorder = _InputRecorder()
    model = nn.Sequential(recorder, _model(nn.ReLU()))
    engine = _RecordingEngine()
    make_private(engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader)
    assert engine.called_with["data_loader"] is loader and engine.called_with["module"] is model
    assert recorder.seen and all(seen.shape[1:] == (2, 6, 6) for seen in recorder.seen)
    assert not any(
        torch.isclose(seen.float(), torch.tensor(0.25)).all() for seen in recorder.seen
    )  # no training example
    assert not [w for w in recwarn if "secure_mode" in str(w.message)]


class MixesFrom(nn.Module):
    """Subtracts the batch mean only in batches of at least `rows` examples: a probe of fewer never sees it mix."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0) if x.shape[0] >= self.rows else x


class ForwardCumsum(nn.Module):
    """Example i depends on examples before it only: example 0 (all the old probe looked at) never changes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.cumsum(0)


class LastTwoMixed(nn.Module):
    """Only the last example depends on another one (the one before it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x[:-1], x[-1:] + x[-2:-1]))


PHYSICAL = 8  # the physical batch the trainer runs in these tests, and the loader's batch size for make_private
MIXERS = [lambda: MixesFrom(4), lambda: MixesFrom(PHYSICAL), ForwardCumsum]
MIXER_IDS = ["batch>=4", "batch>=physical", "cumsum"]


def _images(count: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(count, 2, 6, 6, generator=generator), torch.arange(count) % 4


@pytest.mark.parametrize("mixer", MIXERS, ids=MIXER_IDS)
def test_the_trainer_refuses_mixing_at_the_physical_batch_size_or_forward_in_the_batch(mixer):
    options = dict(noise_multiplier=1.0, target_epsilon=None, batch_size=4, aug_mult=1, augment_padding=0)
    trainer = DPTrainer(
        _model(mixer()), physical_batch_size=PHYSICAL, steps=2, progress=False, ema_decay=None, **options
    )
    with pytest.raises(PrivacyValidationError, match=r"module '2' mixes examples: in a batch of 8"):
        trainer.fit(_images())
    assert trainer.step == 0


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("mixer", MIXERS, ids=MIXER_IDS)
def test_make_private_refuses_mixing_at_the_loaders_batch_size_or_forward_in_the_batch(mixer, verify):
    from equiconvert.privacy import make_private

    model = _model(mixer())
    images, labels = _images()
    private, _, _ = make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=PHYSICAL),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        verify=verify,
    )
    with pytest.raises(PrivacyValidationError, match=r"module '2' mixes examples: in a batch of 8"):
        private(images[:3])  # a first batch smaller than the loader's: the probe runs at the loader's size


def test_opacus_make_private_refuses_mixing_at_the_loaders_batch_size():
    pytest.importorskip("opacus")
    from equiconvert.privacy.opacus_interop import make_private

    model = _model(MixesFrom(4))
    images, labels = _images()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=PHYSICAL)
    with pytest.raises(PrivacyValidationError, match=r"module '2' mixes examples: in a batch of 8"):
        make_private(
            _RecordingEngine(), module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader
        )


@pytest.mark.parametrize("mixer", [ForwardCumsum, LastTwoMixed], ids=["cumsum", "last two"])
def test_mixing_in_either_direction_is_refused_naming_the_examples(mixer):
    with pytest.raises(PrivacyValidationError, match=r"module '2' mixes examples: in a batch of 6, its output for "):
        check_dp_safe(_model(mixer()), EXAMPLE, batch_size=6)


def test_a_group_norm_model_passes_the_probe_at_a_large_batch():
    check_dp_safe(_model(nn.ReLU()), EXAMPLE, batch_size=256)


def test_the_probe_runs_once_per_front_end(monkeypatch):
    from equiconvert.privacy import dp_safety, make_private, private_module
    from equiconvert.training import trainer as trainer_module

    calls: list[int] = []

    def counted(probe):
        def run(*args, **kwargs):
            calls.append(1)
            return probe(*args, **kwargs)

        return run

    monkeypatch.setattr(trainer_module, "check_dp_safe", counted(dp_safety.check_dp_safe))
    monkeypatch.setattr(private_module, "probe_dp_safety", counted(dp_safety.probe_dp_safety))
    images, labels = _images()
    options = dict(noise_multiplier=1.0, target_epsilon=None, batch_size=4, aug_mult=1, augment_padding=0)
    trainer = DPTrainer(_model(nn.ReLU()), steps=3, progress=False, ema_decay=None, **options)
    trainer.fit((images, labels))
    trainer.train_step(images, labels)
    assert len(calls) == 1
    model = _model(nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=4)
    private, optimizer, loader = make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0
    )
    for batch, targets in itertools.islice(loader, 3):
        F.cross_entropy(private(batch), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(calls) == 2


def _clipped_sum(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, clip: float) -> torch.Tensor:
    """The sum of per-example clipped gradients, example i's gradient being that of its own loss under the batched
    forward (what DP-SGD's sensitivity bound is about)."""
    losses = F.cross_entropy(model(images), labels, reduction="none")
    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.zeros(sum(p.numel() for p in params))
    for loss in losses:
        grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params, retain_graph=True)])
        total += grad * min(1.0, clip / float(grad.norm()))
    return total


def test_attack_a_layer_mixing_only_in_larger_batches_breaks_the_sensitivity_bound_and_is_now_refused():
    """Replacing one example changes the clipped sum by at most 2C when examples are independent. A layer that
    mixes only in batches of 4 or more passes a probe at 3 rows (the former probe) and, at the physical batch,
    moves the sum beyond 2C: the noise calibrated to C no longer hides one example. The trainer now probes at
    the batch it runs and refuses the layer."""
    torch.manual_seed(0)
    model = nn.Sequential(MixesFrom(4), nn.Conv2d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 16, 4))
    images, labels = _images(PHYSICAL)
    neighbour = images.clone()
    neighbour[0] = 50.0  # one example replaced
    clip = 0.01
    shift = float((_clipped_sum(model, images, labels, clip) - _clipped_sum(model, neighbour, labels, clip)).norm())
    assert shift > 3 * clip  # the bound 2C is broken: the other examples' clipped gradients moved too
    check_dp_safe(model, images[:3])  # the former probe's batch of 3 sees no mixing
    trainer = DPTrainer(
        model,
        physical_batch_size=PHYSICAL,
        steps=1,
        progress=False,
        ema_decay=None,
        noise_multiplier=1.0,
        target_epsilon=None,
        batch_size=4,
        aug_mult=1,
        augment_padding=0,
    )
    with pytest.raises(PrivacyValidationError, match=r"mixes examples"):
        trainer.fit(_images())
    assert trainer.step == 0
