"""DPTrainer's open interface: Datasets and DataLoaders, optimizer factories, loss_fn, callbacks, loggers,
augmentation callables and per-channel normalisation."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from equiconvert.errors import ParameterError, ParameterTypeError
from equiconvert.training.callbacks import Callback, flat_metrics
from equiconvert.training.dp_config import CUSTOM, CUSTOM_SCHEDULE, ConfigError, DPConfig
from equiconvert.training.trainer import DPTrainer

SIZE, CLASSES, PER_CLASS = 6, 2, 6
OPTIONS = dict(
    noise_multiplier=1.0,
    target_epsilon=None,
    batch_size=6,
    steps=3,
    aug_mult=1,
    lr=0.5,
    ema_decay=None,
    progress=False,
    insecure_seeded_noise=True,
    seed=3,
)


def _model(channels: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * SIZE * SIZE, CLASSES))


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    torchvision = pytest.importorskip("torchvision")
    root = tmp_path_factory.mktemp("folder")
    rng = np.random.default_rng(0)
    for label in range(CLASSES):
        (root / f"class{label}").mkdir()
        for index in range(PER_CLASS):
            pixels = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class{label}" / f"{index}.png")
    return torchvision.datasets.ImageFolder(str(root), transform=torchvision.transforms.ToTensor())


def _tensors(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    return torch.stack(images), torch.tensor(labels)


def _weights(trainer: DPTrainer | nn.Module) -> torch.Tensor:
    model = trainer.model if isinstance(trainer, DPTrainer) else trainer
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_image_folder_and_data_loader_train_as_the_same_tensors(image_folder):
    reference = DPTrainer(_model(), **OPTIONS)
    reference.fit(_tensors(image_folder))
    streamed = DPTrainer(_model(), data_in_memory_bytes=0, **OPTIONS)
    streamed.fit(image_folder, eval_set=image_folder)
    in_memory = DPTrainer(_model(), **OPTIONS)
    in_memory.fit(DataLoader(image_folder, batch_size=4, shuffle=True))
    assert not torch.equal(_weights(reference), _weights(_model()))  # training moved the weights
    torch.testing.assert_close(_weights(streamed), _weights(reference), rtol=0, atol=0)
    torch.testing.assert_close(_weights(in_memory), _weights(reference), rtol=0, atol=0)
    assert streamed.evaluate(image_folder) == reference.evaluate(_tensors(image_folder))
    assert streamed.evaluate(DataLoader(image_folder)) == reference.evaluate(TensorDataset(*_tensors(image_folder)))


def test_dataset_of_non_tensors_is_refused_with_what_to_do(image_folder):
    import torchvision

    raw = torchvision.datasets.ImageFolder(image_folder.root)  # PIL images: no ToTensor transform
    with pytest.raises(TypeError, match="transform that returns tensors"):
        DPTrainer(_model(), **OPTIONS).fit(raw)
    with pytest.raises(TypeError, match="map-style Dataset"):
        DPTrainer(_model(), **OPTIONS).fit([1, 2, 3])


def test_optimizer_factory_builds_the_optimizer_the_steps_use():
    images, labels = torch.rand(12, 3, SIZE, SIZE), torch.randint(0, CLASSES, (12,))
    trainer = DPTrainer(_model(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0), **OPTIONS)
    assert type(trainer.optimizer) is torch.optim.AdamW and trainer.config.optimizer == "custom"
    before = _weights(trainer)
    trainer.fit((images, labels))
    assert trainer.optimizer.state and not torch.equal(before, _weights(trainer))
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        DPTrainer(_model(), optimizer=lambda params: "sgd", **OPTIONS)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        DPTrainer(_model(), optimizer="adam", **OPTIONS)


@pytest.mark.parametrize("method", ["bookkeeping", "vmap"])
def test_loss_fn_is_the_loss_of_the_per_example_gradients(method):
    views, labels = torch.rand(5, 2, 3, SIZE, SIZE), torch.randint(0, CLASSES, (5,))
    gradients = {}
    for name, loss_fn in (("default", None), ("doubled", lambda z, y: 2 * F.cross_entropy(z, y, reduction="none"))):
        trainer = DPTrainer(_model(), per_sample_method=method, loss_fn=loss_fn, **OPTIONS)
        params = {n: p.detach() for n, p in trainer.model.named_parameters()}
        gradients[name], _ = trainer._per_sample_gradients(params, {}, views, labels)
    assert trainer.per_sample_method == method  # the probe accepted the custom loss
    for name, value in gradients["default"].items():
        torch.testing.assert_close(gradients["doubled"][name], 2 * value)
    trainer = DPTrainer(_model(), per_sample_method=method, loss_fn=lambda z, y: F.cross_entropy(z, y), **OPTIONS)
    with pytest.raises((ValueError, RuntimeError), match="one loss per example|scalar"):
        trainer._per_sample_gradients(params, {}, views, labels)


class _Recorder(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.evaluations: list[dict[str, float]] = []

    def on_step_end(self, trainer, record):
        self.steps.append(record["step"])
        assert trainer.step == record["step"]

    def on_eval_end(self, trainer, metrics):
        self.evaluations.append(metrics)


class _FakeLogger:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics, step):
        self.calls.append((metrics, step))


def test_callbacks_and_metrics_logger_see_every_step_and_evaluation():
    data = torch.rand(12, 3, SIZE, SIZE), torch.randint(0, CLASSES, (12,))
    recorder, logger = _Recorder(), _FakeLogger()
    trainer = DPTrainer(_model(), callbacks=[recorder], metrics_logger=logger, eval_every=2, epsilon_every=1, **OPTIONS)
    trainer.fit(data, eval_set=data)
    assert recorder.steps == [1, 2, 3]
    assert len(recorder.evaluations) == 2 and recorder.evaluations[-1] == trainer.history[-1]["final_eval"]
    by_step = {}
    for metrics, step in logger.calls:
        by_step.setdefault(step, {}).update(metrics)
    assert by_step[2]["eval/accuracy"] == recorder.evaluations[0]["accuracy"]
    assert by_step[3]["epsilon"] == trainer.epsilon and by_step[3]["lr"] == 0.5
    assert flat_metrics({"step": 1, "event": "stopped", "eval": {"loss": 1}}) == {"eval/loss": 1.0}
    with pytest.raises(TypeError, match="metrics_logger must have log_metrics"):
        DPTrainer(_model(), metrics_logger=object(), **OPTIONS)
    with pytest.raises(TypeError, match="callbacks must be"):
        DPTrainer(_model(), callbacks=[print], **OPTIONS)


def test_augment_callable_makes_the_views_on_the_device():
    seen = []

    def augment(images, num_views, generator):
        seen.append((images.device, num_views, generator.device))
        return torch.stack([images, images.flip(-1)], dim=1)[:, :num_views]

    data = torch.rand(12, 3, SIZE, SIZE), torch.randint(0, CLASSES, (12,))
    trainer = DPTrainer(_model(), augment=augment, **{**OPTIONS, "aug_mult": 2})
    trainer.fit(data)
    assert seen and all(entry == (trainer.device, 2, trainer.device) for entry in seen)
    with pytest.raises(TypeError, match="augment must be callable"):
        DPTrainer(_model(), augment="crop", **OPTIONS)


def test_per_channel_normalisation_is_applied_and_validated_at_construction():
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    trainer = DPTrainer(_model(), normalize_mean=mean, normalize_std=std, **OPTIONS)
    images = torch.rand(2, 3, SIZE, SIZE)
    expected = (images - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    torch.testing.assert_close(trainer._normalize(images), expected)
    for bad, match in (
        ({"normalize_std": (0.5, 0.0, 1.0)}, "normalize_std must be > 0"),
        ({"normalize_mean": (0.1, 0.2)}, "different channel counts"),
        ({"normalize_mean": ("a", 0.2, 0.3)}, "normalize_mean must be a number"),
        ({"normalize_std": ()}, "normalize_std must be finite numbers"),
    ):
        with pytest.raises(ValueError, match=match):
            DPTrainer(_model(), **{**OPTIONS, "normalize_mean": mean, "normalize_std": std, **bad})
    one_channel = torch.rand(12, 1, SIZE, SIZE), torch.randint(0, CLASSES, (12,))
    with pytest.raises(ValueError, match="give 3 channels; the images have 1"):
        DPTrainer(_model(1), normalize_mean=mean, normalize_std=std, **OPTIONS).fit(one_channel)


def test_tensorboard_logger_only_when_tensorboard_is_installed(tmp_path, monkeypatch):
    from equiconvert.training import callbacks

    monkeypatch.setattr(callbacks, "tensorboard_available", lambda: False)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        callbacks.TensorBoardLogger(tmp_path)
    assert isinstance(_FakeLogger(), callbacks.MetricsLogger)


def test_tensor_data_is_one_name_for_one_thing():
    """The trainer's TensorData is train_data's class (the (images, labels) tuple type is ImagesAndLabels)."""
    from equiconvert.training import audit, train_data, trainer

    assert trainer.TensorData is train_data.TensorData
    assert audit.ImagesAndLabels == trainer.ImagesAndLabels == tuple[torch.Tensor, torch.Tensor]


def _trained_weights(**arguments) -> torch.Tensor:
    images = torch.randint(0, 256, (PER_CLASS * CLASSES, 3, SIZE, SIZE), dtype=torch.uint8)
    labels = torch.arange(CLASSES).repeat_interleave(PER_CLASS)
    trainer = DPTrainer(_model(), progress=False, **arguments)
    trainer.fit((images, labels))
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def test_a_dpconfig_trains_exactly_as_its_fields_given_as_keywords():
    options = {k: v for k, v in OPTIONS.items() if k != "progress"}
    torch.manual_seed(0)
    by_keywords = _trained_weights(**options)
    torch.manual_seed(0)
    by_config = _trained_weights(config=DPConfig(**options))
    assert torch.equal(by_keywords, by_config)
    assert not torch.equal(by_config, torch.cat([p.detach().flatten() for p in _model().parameters()]))


def test_config_is_kept_as_given_and_still_checked():
    config = DPConfig(**{k: v for k, v in OPTIONS.items() if k != "progress"})
    assert DPTrainer(_model(), progress=False, config=config).config is config
    with pytest.raises(ConfigError, match="lr"):
        DPTrainer(_model(), progress=False, config=dataclasses.replace(config, lr=-1.0))


def test_config_and_keyword_options_together_are_refused_naming_both():
    config = DPConfig(**{k: v for k, v in OPTIONS.items() if k != "progress"})
    with pytest.raises(ParameterError, match=r"config= and \['lr'\]"):
        DPTrainer(_model(), progress=False, config=config, lr=0.1)
    with pytest.raises(ParameterError, match="config.lr_schedule"):
        DPTrainer(_model(), progress=False, config=config, lr_schedule="cosine")
    with pytest.raises(ParameterTypeError, match="config must be a DPConfig, got dict"):
        DPTrainer(_model(), progress=False, config=dataclasses.asdict(config))


def test_config_takes_a_schedule_callable_and_an_optimizer_factory_beside_it():
    config = DPConfig(**{k: v for k, v in OPTIONS.items() if k != "progress"})
    factory = functools.partial(torch.optim.SGD, lr=0.25)
    trainer = DPTrainer(_model(), progress=False, config=config, lr_schedule=lambda step: 0.25, optimizer=factory)
    assert (trainer.config.lr_schedule, trainer.config.optimizer) == (CUSTOM_SCHEDULE, CUSTOM)
    assert trainer.lr_schedule(0) == 0.25 and isinstance(trainer.optimizer, torch.optim.SGD)
    assert config.lr_schedule == DPConfig.lr_schedule  # the caller's config is not changed
