"""Buffers written from the input are refused before the model being trained sees any data (DPTrainer and
make_private); state that forward changes the same way for any input is allowed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import equiconvert
from equiconvert.models import equivariant_resnet9, resnet9
from equiconvert.privacy import check_dp_safe, make_private
from equiconvert.privacy.trainer import DPTrainer
from equiconvert.privacy.validate import PrivacyValidationError, validate_dp_safe

CHANNELS = 3


class ActNorm(nn.Module):
    """Glow's data-dependent initialisation: the shift is minus the channel means of the first batch it sees."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("shift", torch.zeros(1, channels, 1, 1))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            with torch.no_grad():
                self.shift.copy_(-x.mean((0, 2, 3), keepdim=True))
                self.initialized.fill_(1)
        return x + self.shift


class ActNormParameter(nn.Module):
    """The same initialisation written into a trainable parameter."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, channels, 1, 1))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            with torch.no_grad():
                self.loc.copy_(-x.mean((0, 2, 3), keepdim=True))
                self.initialized.fill_(1)
        return x + self.loc


class FeatureAverage(nn.Module):
    """A running mean of the features under a name the name-based check does not know."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("feature_avg", torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.feature_avg.mul_(0.9).add_(0.1 * x.detach().mean((0, 2, 3)))
        return x


class StepCounter(nn.Module):
    """Counts forwards: changes in every forward, the same way for any input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return x


class LazyConstant(nn.Module):
    """A cache built on the first forward from constants (like a basis expansion), then read; NaN until built."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((1, channels, 1, 1), float("nan")), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale.isnan().any():
            self.scale.copy_(torch.linspace(0.5, 1.5, self.scale.shape[1]).view_as(self.scale))
        return x * self.scale


def _model(middle: nn.Module) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, CHANNELS, 3), nn.GroupNorm(1, CHANNELS), middle, nn.Flatten(), nn.Linear(CHANNELS * 16, 4)
    )


def _data(count: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.rand(count, 2, 6, 6, generator=generator) - 2.0, torch.arange(count) % 4  # non-zero mean, normalised (negative) values


def _trainer(model: nn.Module, **options) -> DPTrainer:
    settings = dict(
        noise_multiplier=1.0,
        target_epsilon=None,
        batch_size=4,
        steps=1,
        aug_mult=1,
        augment_padding=0,
        augment_flip=False,
        progress=False,
        ema_decay=None,
        insecure_seeded_noise=True,
    )
    with pytest.warns(UserWarning, match="NOT differentially private"):
        return DPTrainer(model, device="cpu", **{**settings, **options})


def _make_private(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, **options):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="NOT differentially private"):
        return make_private(
            module=model,
            optimizer=optimizer,
            data_loader=DataLoader(TensorDataset(images, labels), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            debug_seed=0,
            **options,
        )


def _one_private_step(private: nn.Module, optimizer, images: torch.Tensor, labels: torch.Tensor) -> None:
    F.cross_entropy(private(images), labels).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_data_dependent_initialisation_is_refused_before_the_trainer_touches_the_model(tmp_path):
    model = _model(ActNorm(CHANNELS))
    validate_dp_safe(model)  # the name-based check alone lets it through
    trainer = _trainer(model, out_dir=tmp_path / "run")
    with pytest.raises(
        PrivacyValidationError,
        match=r"module '2' changes its buffer 'shift' from its input .*first forward \(data-dependent initialisation",
    ):
        trainer.fit(_data())
    assert trainer.step == 0
    assert not (tmp_path / "run" / "model.pt").exists()
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    # the model to be released never ran on training data: its buffers are as they were built
    assert torch.equal(model[2].shift, torch.zeros(1, CHANNELS, 1, 1))
    assert int(model[2].initialized) == 0


def test_data_dependent_initialisation_of_a_parameter_is_refused():
    with pytest.raises(PrivacyValidationError, match=r"module '2' changes its parameter 'loc' from its input"):
        check_dp_safe(_model(ActNormParameter(CHANNELS)), torch.zeros(2, 2, 6, 6))


@pytest.mark.parametrize("verify", [True, False])
def test_a_running_mean_named_feature_avg_is_refused_by_make_private_before_the_module_runs(verify):
    model = _model(FeatureAverage(CHANNELS))
    images, labels = _data()
    private, _, _ = _make_private(model, images, labels, verify=verify)
    with pytest.raises(
        PrivacyValidationError,
        match=r"module '2' changes its buffer 'feature_avg' from its input .*every forward \(running statistics\)",
    ):
        private(images[:4])
    assert torch.equal(model[2].feature_avg, torch.zeros(CHANNELS))  # the module itself never ran
    with pytest.raises(PrivacyValidationError, match="feature_avg"):  # and it is refused again, not let through
        private.eval()(images[:4])
    assert torch.equal(model[2].feature_avg, torch.zeros(CHANNELS))


@pytest.mark.parametrize("middle", [StepCounter, lambda: LazyConstant(CHANNELS)], ids=["step counter", "lazy cache"])
def test_state_that_changes_the_same_way_for_any_input_is_allowed(middle):
    images, labels = _data()
    check_dp_safe(_model(middle()), images)  # DPTrainer's check
    model = _model(middle())
    private, optimizer, _ = _make_private(model, images, labels, verify=False)
    _one_private_step(private, optimizer, images[:4], labels[:4])
    reference = _model(middle())
    reference(images[:4])  # the probes ran on copies: the module's state is that of one forward
    for name, value in reference[2].named_buffers():
        assert torch.equal(model[2].get_buffer(name), value)


def test_the_trainer_runs_no_forward_of_its_model_outside_training_steps():
    counter = StepCounter()
    trainer = _trainer(_model(counter), steps=0)
    trainer.fit(_data())
    assert int(counter.steps) == 0  # num_classes and the DP-safety probes ran on copies


def _converted_resnet9() -> nn.Module:
    return equiconvert.make_equivariant(resnet9(widths=(8, 8, 8), num_classes=4), "D4", head="invariant")


def test_converted_models_are_accepted_by_the_trainer_and_make_private():
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.rand(4, 3, 16, 16, generator=generator), torch.arange(4) % 4
    check_dp_safe(equivariant_resnet9("D4", layout=(8, 8, 16), input_size=16), images)
    trainer = _trainer(_converted_resnet9(), batch_size=2)
    trainer.fit((images, labels))
    assert trainer.step == 1
    private, optimizer, _ = _make_private(_converted_resnet9(), images, labels)
    _one_private_step(private, optimizer, images[:2], labels[:2])


def test_a_lazy_module_is_refused_with_what_to_do_and_accepted_once_materialised():
    from equiconvert.privacy.dp_safety import PrivacyValidationError

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    example = torch.zeros(1, 3, 6, 6)
    with pytest.raises(PrivacyValidationError, match=r"parameter '2.weight' is uninitialised .*zero input"):
        check_dp_safe(model, example)
    model(example)
    check_dp_safe(model, example)
