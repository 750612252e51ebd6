"""Buffers written from the input, or by every forward, are refused before the model being trained sees any data
(DPTrainer and make_private), and any other buffer write in a training forward at run time; state that forward sets
once, the same way for any input, is allowed."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import equiconvert
from equiconvert.models import equivariant_resnet9, resnet9
from equiconvert.privacy import check_dp_safe, make_private
from equiconvert.training.trainer import DPTrainer
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


class ExampleCounter(nn.Module):
    """Adds each batch's number of examples to a buffer: trained, it holds the sum of the secret batch sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += x.shape[0]
        return x


class CountsImageBatches(ExampleCounter):
    """Counts only training batches whose values all lie in [-1, 1] (images as the front-ends feed them), which a
    random normal probe batch never is: a buffer the one-off probe cannot see written."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and bool((x.abs() <= 1).all()):
            self.count += x.shape[0]
        return x


class ParameterCache(nn.Module):
    """A buffer rewritten in every forward from another layer's weight (it changes after each step, never with the
    data); the layer is referenced, not registered, so its parameters have one owner."""

    def __init__(self, source: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "source", source)
        self.register_buffer("cached", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cached.copy_(self.source.weight.detach().norm())
        return x


def _cached_model() -> nn.Sequential:
    model = _model(nn.Identity())
    model[2] = ParameterCache(model[0])
    return model


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
    return torch.rand(count, 2, 6, 6, generator=generator) - 2.0, torch.arange(
        count
    ) % 4  # non-zero mean, normalised (negative) values


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


def test_state_that_forward_sets_once_the_same_way_for_any_input_is_allowed():
    images, labels = _data()
    check_dp_safe(_model(LazyConstant(CHANNELS)), images)  # DPTrainer's check
    model = _model(LazyConstant(CHANNELS))
    private, optimizer, _ = _make_private(model, images, labels, verify=False)
    _one_private_step(private, optimizer, images[:4], labels[:4])
    reference = _model(LazyConstant(CHANNELS))
    reference(images[:4])  # the probes ran on copies: the module's state is that of one forward
    for name, value in reference[2].named_buffers():
        assert torch.equal(model[2].get_buffer(name), value)


def test_a_lazy_cache_passes_the_trainers_run_time_guard():
    """A buffer that forward sets from constants: the guard's shadow forward agrees at every step."""
    images, labels = _data(16)
    trainer = _trainer(_model(LazyConstant(CHANNELS)), steps=3)
    trainer.fit((images, labels))
    assert trainer.step == 3


@pytest.mark.parametrize("build", [lambda: _model(LazyConstant(CHANNELS)), _cached_model], ids=["lazy", "of weights"])
def test_caches_pass_the_run_time_guard_of_make_private(build):
    """Buffers that forward sets from constants or parameters only: the guard's shadow forward agrees every step
    (verify off: torch.func, which the book-keeping check compares with, cannot write buffers)."""
    images, labels = _data(16)
    model = build()
    private, optimizer, loader = _make_private(model, images, labels, verify=False)
    for batch, targets in itertools.islice(itertools.cycle(loader), 3):
        _one_private_step(private, optimizer, batch, targets)
    if isinstance(model[2], ParameterCache):
        before = float(model[2].cached)
        _one_private_step(private, optimizer, images[:4], labels[:4])
        assert float(model[2].cached) != before  # rewritten from the stepped weights, and accepted


def test_a_forward_counter_is_refused_by_both_front_ends():
    """The number of forwards in a step follows the secret batch size (the trainer's physical chunks, an empty
    batch, BatchMemoryManager): a count of forwards is a count of batch sizes."""
    images, labels = _data(16)
    trainer = _trainer(_model(StepCounter()), physical_batch_size=1)
    with pytest.raises(PrivacyValidationError, match=r"module '2' changes its buffer 'steps' in every forward"):
        trainer.fit((images, labels))
    private, _, _ = _make_private(_model(StepCounter()), images, labels)
    with pytest.raises(PrivacyValidationError, match=r"module '2' changes its buffer 'steps' in every forward"):
        private(images[:4])


class _CallCounter(nn.Module):
    """Counts its forwards in a plain attribute (each deep copy counts its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def test_the_trainer_runs_no_forward_of_its_model_outside_training_steps():
    counter = _CallCounter()
    trainer = _trainer(_model(counter), steps=0)
    trainer.fit(_data())
    assert counter.calls == 0  # num_classes and the DP-safety probes ran on copies


@pytest.mark.parametrize("verify", [True, False])
def test_a_buffer_counting_examples_is_refused_by_make_private_naming_it(verify):
    model = _model(ExampleCounter())
    images, labels = _data()
    private, _, _ = _make_private(model, images, labels, verify=verify)
    with pytest.raises(
        PrivacyValidationError, match=r"module '2' changes its buffer 'count' from its input .*number of examples"
    ):
        private(images[:4])
    assert int(model[2].count) == 0  # the released model holds no batch size


def test_a_buffer_counting_examples_is_refused_by_the_trainer_naming_it():
    model = _model(ExampleCounter())
    trainer = _trainer(model, steps=2)
    with pytest.raises(
        PrivacyValidationError, match=r"module '2' changes its buffer 'count' from its input .*number of examples"
    ):
        trainer.fit(_data())
    assert trainer.step == 0 and int(model[2].count) == 0


def test_a_buffer_written_on_batches_the_probe_does_not_draw_is_refused_at_run_time_by_make_private():
    model = nn.Sequential(CountsImageBatches(), _model(nn.ReLU()))
    images, labels = _data()
    images = images + 2.0  # in [0, 1]
    private, _, _ = _make_private(model, images, labels)
    with pytest.raises(PrivacyValidationError, match=r"module '0' changed its buffer 'count' in a training forward"):
        private(images[:4])
    assert int(model[0].count) == 0  # set back before the error: the model never holds the batch size


def test_a_buffer_written_on_batches_the_probe_does_not_draw_is_refused_at_run_time_by_the_trainer():
    model = nn.Sequential(CountsImageBatches(), _model(nn.ReLU()))
    images, labels = _data(16)
    trainer = _trainer(model, steps=2)
    with pytest.raises(PrivacyValidationError, match=r"module '0' changed its buffer 'count' in a training forward"):
        trainer.fit((images + 2.0, labels))  # images in [0, 1], normalised to [-1, 1]
    # the trainer reads its queued checks where it waits for the device anyway, before any record, evaluation or
    # checkpoint leaves it: the run stops there, with the buffer set back
    assert int(model[0].count) == 0
    assert not any("eval" in record or "final_eval" in record for record in trainer.history)


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


def test_train_step_without_fit_probes_the_model_too():
    model = _model(ExampleCounter())
    images, labels = _data(16)
    trainer = _trainer(model)
    trainer._prepare_privacy(len(images))
    with pytest.raises(PrivacyValidationError, match=r"module '2' changes its buffer 'count' from its input"):
        trainer.train_step(images, labels)
    assert trainer.step == 0 and int(model[2].count) == 0


def test_attack_a_trained_example_counter_does_not_reveal_the_secret_batch_sizes():
    """The attack: train with the user's own loop, then read the released buffer: the sum of the Poisson batch
    sizes. The first training forward is refused instead, and the buffer holds nothing of the batches."""
    model = _model(ExampleCounter())
    images, labels = _data(16)
    private, optimizer, loader = _make_private(model, images, labels)
    sizes: list[int] = []
    with pytest.raises(PrivacyValidationError, match="'count'"):
        for batch, targets in itertools.islice(loader, 4):
            sizes.append(len(batch))
            _one_private_step(private, optimizer, batch, targets)
    assert sum(sizes) > 0 and int(model[2].count) == 0


def test_opacus_make_private_guards_the_training_forwards():
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine

    from equiconvert.privacy.opacus_interop import make_private as opacus_make_private

    model = nn.Sequential(CountsImageBatches(), _model(nn.ReLU()))
    images, labels = _data()
    loader = DataLoader(TensorDataset(images + 2.0, labels), batch_size=4)
    with pytest.warns(UserWarning, match="secure_mode=False"):
        private, _, _ = opacus_make_private(
            PrivacyEngine(),
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    with pytest.raises(PrivacyValidationError, match=r"module '0' changed its buffer 'count' in a training forward"):
        private(images[:4] + 2.0)
    assert int(model[0].count) == 0


def test_a_deferred_guard_queues_its_checks_and_refuses_at_verify_with_the_buffer_set_back():
    from equiconvert.privacy.buffer_guard import BufferGuard

    model = nn.Sequential(CountsImageBatches()).train()
    guard = BufferGuard(model, deferred=True)
    batch = torch.zeros(5, 3)
    with guard.watch(batch):
        model(batch)  # counts 5: nothing is read from the device yet
    assert int(model[0].count) == 5
    with pytest.raises(PrivacyValidationError, match=r"module '0' changed its buffer 'count'"):
        guard.verify()
    assert int(model[0].count) == 0
    guard.verify()  # the queue was emptied: nothing is refused twice
