"""Bad inputs refused up front with clear errors: non-finite data, labels, delta, budget, frozen parameters."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from equiconvert.data import DatasetFormatError, UnknownDatasetError, load_dataset
from equiconvert.data._base import make_image_data
from equiconvert.data.rotated_mnist import NPZ_NAMES
from equiconvert.image_shape import ImageShapeError
from equiconvert.privacy.accounting import PrivacyBudgetError, default_delta
from equiconvert.training.dp_config import DPConfig
from equiconvert.training.inputs import InvalidDataError
from equiconvert.training.trainer import DPTrainer
from equiconvert.privacy.validate import PrivacyValidationError
from tests.support.cli_errors import run_error
from tests.support.tiny import CLASSES, N, SIZE, linear_classifier, tiny_images
from tests.support.train_args import tiny_train_args

OPTIONS = dict(
    noise_multiplier=1.0,
    target_epsilon=None,
    batch_size=8,
    steps=1,
    aug_mult=1,
    lr=1.0,
    ema_decay=None,
    augment_padding=0,
    augment_flip=False,
    progress=False,
)


# --- non-finite inputs and gradients ----------------------------------------------------------------------------


def test_non_finite_image_is_refused_naming_its_index():
    images, labels = tiny_images()
    images[5, 0, 1, 2] = float("nan")
    trainer = DPTrainer(linear_classifier(), **OPTIONS)
    with pytest.raises(InvalidDataError, match=r"images\[5\] holds a non-finite value"):
        trainer.fit((images, labels))
    assert trainer.step == 0 and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    images[5] = 0.0
    images[7, 0, 0, 0] = float("inf")
    with pytest.raises(InvalidDataError, match=r"evaluation data images\[7\]"):
        DPTrainer(linear_classifier(), **OPTIONS).fit(tiny_images(), eval_set=(images, labels))


def test_loader_refuses_non_finite_float_images_naming_file_and_index(tmp_path):
    images = np.full((4, 1, 2, 2), 0.5, dtype=np.float32)
    images[2, 0, 0, 0] = np.nan
    with pytest.raises(DatasetFormatError, match=r"digits \(/data/x.npz\): image 2 holds a non-finite value"):
        make_image_data(images, np.arange(4), ["a", "b", "c", "d"], "digits", source="/data/x.npz")
    with pytest.raises(DatasetFormatError, match="labels have dtype float"):
        make_image_data(images[:2] * 0, np.array([0.0, 1.5]), ["a", "b"], "digits")
    digits = np.full((10, 28, 28), 100.0)
    digits[6, 3, 3] = np.inf
    np.savez(path := tmp_path / NPZ_NAMES[0], images=digits, labels=np.arange(10))
    with pytest.raises(DatasetFormatError, match=rf"{re.escape(str(path))} \(images\): image 6 holds a non-finite"):
        load_dataset("rotated_mnist", tmp_path, "train")


class SqrtOfMagnitude(nn.Module):
    """sqrt|x|: at x = 0 the gradient is 0 * inf = NaN, for finite inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().sqrt()


@pytest.mark.parametrize("method", ["bookkeeping", "vmap"])
def test_non_finite_per_example_gradient_counts_as_zero(method):
    images, labels = tiny_images()
    images[[3, 9]] = 0.5  # normalised to exactly 0: the linear layer's output is its (zero) bias
    model = nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, CLASSES), SqrtOfMagnitude())
    with torch.no_grad():
        model[1].bias.zero_()
    options = {**OPTIONS, "batch_size": N, "steps": 1, "per_sample_method": method, "log_nonprivate_stats": True}
    trainer = DPTrainer(model, **options)
    history = trainer.fit((images, labels))
    assert trainer.nonfinite_gradients == 2 and history[0]["nonfinite_gradients"] == 2
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# --- delta against 1/N --------------------------------------------------------------------------------------------


def test_delta_is_checked_against_the_data_set_size():
    with pytest.raises(PrivacyBudgetError, match=r"delta=0.5 >= 1/N = 1/32"):
        DPTrainer(linear_classifier(), **{**OPTIONS, "delta": 0.5}).fit(tiny_images())
    with pytest.warns(UserWarning, match=r"delta 0.01 > 1/\(10 N\)"):
        DPTrainer(linear_classifier(), **{**OPTIONS, "delta": 0.01}).fit(tiny_images())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = DPTrainer(linear_classifier(), **OPTIONS)
        trainer.fit(tiny_images())
    assert trainer.delta == default_delta(N) == 1e-5


def test_default_delta_follows_the_data_set_size():
    assert default_delta(10_000) == 1e-5
    assert default_delta(50_000) == default_delta(60_000) == 1e-6
    assert default_delta(1_281_167) == 1e-8
    for n in (1, 999, 10_000):
        assert default_delta(n) == 1e-5
    for n in (10_001, 100_000, 1_281_167, 10**9):  # the largest power of ten <= 1/(10 N)
        assert 1 / (100 * n) < default_delta(n) <= 1 / (10 * n)


# --- frozen parameters ----------------------------------------------------------------------------------------------


def test_frozen_parameters_get_no_gradient_no_noise_and_both_methods_agree():
    images, labels = tiny_images()
    results = {}
    for method in ("bookkeeping", "vmap"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, 8), nn.Tanh(), nn.Linear(8, CLASSES))
        model[1].requires_grad_(False)
        frozen = model[1].weight.detach().clone()
        trainer = DPTrainer(
            model, per_sample_method=method, insecure_seeded_noise=True, **{**OPTIONS, "steps": 2, "batch_size": 16}
        )
        params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
        grads, _ = trainer._per_sample_gradients(params, {}, trainer._normalize(images[:4]).unsqueeze(1), labels[:4])
        assert set(grads) == {"3.weight", "3.bias"}  # clipping norms see the trainable parameters only
        trainer.fit((images, labels))
        assert torch.equal(model[1].weight, frozen) and model[1].weight.grad is None
        results[method] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, value in results["vmap"].items():
        torch.testing.assert_close(results["bookkeeping"][name], value, rtol=1e-5, atol=1e-6)


# --- labels -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "labels, message",
    [
        (torch.full((N,), 3), r"labels\[0\] = 3 is outside \[0, 3\)"),
        (torch.arange(N) % 3 - (torch.arange(N) == 4).long() * 5, r"labels\[4\] = -4 is outside"),
        (torch.zeros(N), "dtype torch.float32; give integer class indices"),
        (torch.zeros(N - 1, dtype=torch.long), "has 32 images but 31 labels"),
    ],
    ids=["out-of-range", "negative", "float", "shorter"],
)
def test_bad_labels_are_refused_through_the_api(labels, message):
    images, _ = tiny_images()
    with pytest.raises(InvalidDataError, match=message):
        DPTrainer(linear_classifier(), **OPTIONS).fit((images, labels))


# --- CLI: every input validated before data, clear one-line errors ------------------------------------------------


def test_cli_errors_name_the_flag_before_any_data_is_loaded(tmp_path, capsys):
    missing = str(tmp_path / "no-data-here")  # loading cifar10 from here would fail: the flag check comes first
    for flag, value in (
        ("--epsilon", "-1"),
        ("--delta", "2"),
        ("--lr", "0"),
        ("--physical-batch-size", "0"),
        ("--set", "schedule.ema_decay=1.5"),
        ("--steps", "0"),
    ):
        error = run_error(
            capsys, "train", "--dataset", "cifar10", "--data-dir", missing, "--out", str(tmp_path / "o"), flag, value
        )
        assert error.startswith(f"error: {flag} ") and "target_epsilon" not in error, error
    assert not (tmp_path / "o").exists()


def test_unknown_dataset_is_one_clear_line(tmp_path, capsys):
    error = run_error(capsys, "train", "--dataset", "imagenet9000", "--out", str(tmp_path / "o"))
    assert "--dataset imagenet9000: unknown data set; known:" in error
    with pytest.raises(UnknownDatasetError):
        load_dataset("imagenet9000")


def test_empty_test_split_is_refused_before_training(tmp_path, monkeypatch):
    from equiconvert.recipes import runner as run

    def fail(*args, **kwargs):
        raise AssertionError("DPTrainer was built although the test split is empty")

    monkeypatch.setattr(run, "DPTrainer", fail)
    spec = run.RunSpec(
        model="equiconvert:resnet9",
        group="none",
        dataset="synthetic",
        data_dir=None,
        out=str(tmp_path / "o"),
        model_kwargs={"widths": (4, 8, 8)},
        progress=False,
    )
    import equiconvert.data as data

    real = data.load_dataset
    monkeypatch.setattr(
        data,
        "load_dataset",
        lambda name, data_dir=None, split="train": real(
            name, data_dir, split, num_examples=0 if split == "test" else 64
        ),
    )
    with pytest.raises(ValueError, match="test split of 'synthetic' is empty"):
        run.run_checked(spec, DPConfig(batch_size=8, steps=1))


def test_first_step_over_budget_fails_with_a_message(tmp_path, capsys):
    trainer = DPTrainer(linear_classifier(), **{**OPTIONS, "target_epsilon": 0.1, "noise_multiplier": 0.5})
    with pytest.raises(PrivacyBudgetError, match=r"one step .* spends epsilon .* > the target 0.1"):
        trainer.fit(tiny_images())
    args = tiny_train_args(
        tmp_path / "o",
        "--set",
        "dp.noise_multiplier=0.5",
        model="equiconvert:resnet9",
        model_kwargs="widths=4,8,8",
        group="none",
        steps=2,
        epsilon=0.1,
    )
    error = run_error(capsys, *args, code=4)  # a privacy error
    assert "spends epsilon" in error and not (tmp_path / "o" / "result.json").exists()


def test_one_dimensional_images_are_refused_by_shape_before_any_probe():
    trainer = DPTrainer(linear_classifier(), **OPTIONS)
    with pytest.raises(InvalidDataError, match=r"images must be a tensor \(N, C, H, W\), got shape \(1,\)"):
        trainer.fit((torch.rand(N), torch.arange(N) % CLASSES))
    assert trainer.step == 0


def test_an_out_dir_that_is_a_file_is_refused_when_the_trainer_is_built(tmp_path):
    path = tmp_path / "run"
    path.write_text("not a folder")
    with pytest.raises(ValueError, match=r"out_dir .*run is a file: give a folder"):
        DPTrainer(linear_classifier(), out_dir=path, **OPTIONS)


# --- pixel scale, dtype and layout of the images ------------------------------------------------------------------


def _with_value(images: torch.Tensor, value: float) -> torch.Tensor:
    """`images` with its first entry set to `value`."""
    images = images.clone()
    images.view(-1)[0] = value
    return images


@pytest.mark.parametrize(
    "images, message",
    [
        (
            tiny_images()[0] * 255,
            r"images hold values in \[[\d.]+, [\d.]+\] \(images\[0\] exceeds 1\).* 255, or give uint8",
        ),
        (  # one value below 0 does not make pixels in [0, 255] normalised
            _with_value(tiny_images()[0] * 255, -0.5),
            r"images\[0\] exceeds 32 in magnitude\).* these are pixels in \[0, 255\] .* divide them by 255",
        ),
        ((tiny_images()[0] * 255).long(), r"images have dtype torch.int64: give uint8 pixels \(0-255\) or floats"),
        ((tiny_images()[0] * 255).int(), r"images have dtype torch.int32"),
    ],
    ids=["float 0-255", "float 0-255 with a negative value", "int64", "int32"],
)
def test_images_on_the_pixel_scale_or_of_an_integer_dtype_are_refused(images, message):
    labels = tiny_images()[1]
    trainer = DPTrainer(linear_classifier(), **OPTIONS)
    with pytest.raises(InvalidDataError, match=message) as err:
        trainer.fit((images, labels))
    assert "\n" not in str(err.value) and trainer.step == 0
    with pytest.raises(InvalidDataError, match=message):  # a Dataset streamed example by example too
        DPTrainer(linear_classifier(), data_in_memory_bytes=0, **OPTIONS).fit(
            torch.utils.data.TensorDataset(images, labels)
        )


def test_the_whole_set_is_checked_not_only_its_first_example():
    images, labels = tiny_images()
    images[5] *= 255
    with pytest.raises(InvalidDataError, match=r"images\[5\] exceeds 1"):
        DPTrainer(linear_classifier(), **OPTIONS).fit((images, labels))


def test_pixels_in_unit_range_uint8_and_normalised_floats_train():
    images, labels = tiny_images()
    for accepted in (images, (images * 255).to(torch.uint8), (images - 0.5) / 0.25, images * (1 + 1e-4)):
        assert DPTrainer(linear_classifier(), **OPTIONS).fit((accepted, labels))[-1]["step"] == 1


def test_float64_images_and_int8_labels_train_as_float32_images_and_class_indices():
    """Both used to fail inside the first forward or the loss with torch's dtype error."""
    images, labels = tiny_images()
    trainer = DPTrainer(linear_classifier(), **OPTIONS)
    assert trainer.fit((images.double(), labels.to(torch.int8)))[-1]["step"] == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def _conv_net(channels: int = 3) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(channels, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, CLASSES)
    )


@pytest.mark.parametrize(
    "shape, fix",
    [
        ((N, 5, 5, 3), r"they look channels-last \(N, H, W, C\): give images.permute\(0, 3, 1, 2\)"),
        ((N, 1, 5, 5), r"give \(N, 3, H, W\) images with the channels the model's first layer takes"),
        ((N, 5, 5), r"give \(N, 3, H, W\) images"),
    ],
    ids=["channels-last", "wrong channels", "N H W"],
)
def test_images_of_another_layout_are_one_line_naming_the_fix(shape, fix):
    """These used to fail inside the first convolution (or the DP probes) with torch's RuntimeError."""
    labels = torch.arange(N) % CLASSES
    with pytest.raises(ImageShapeError, match=rf"^the training data images have shape \({shape[0]}, .*: {fix}$"):
        DPTrainer(_conv_net(), **OPTIONS).fit((torch.rand(shape), labels))


def test_one_channel_images_without_a_channel_dimension_are_told_to_unsqueeze():
    with pytest.raises(ImageShapeError, match=r"\(N, 1, H, W\): add the channel dimension, images.unsqueeze\(1\)$"):
        DPTrainer(_conv_net(1), **OPTIONS).fit((torch.rand(N, 5, 5), torch.arange(N) % CLASSES))


def test_an_equivariant_model_called_on_channels_last_images_says_what_to_pass():
    import equiconvert

    model = equiconvert.make_equivariant(_conv_net(), "C4", head="invariant")
    with pytest.raises(ImageShapeError, match=r"^images have shape \(2, 9, 9, 3\) .* images.permute\(0, 3, 1, 2\)$"):
        model(torch.rand(2, 9, 9, 3))
    assert model(torch.rand(2, 3, 9, 9)).shape == (2, CLASSES)


def test_make_equivariant_of_a_name_says_to_pass_a_module():
    """A string used to fail as AttributeError: 'str' object has no attribute 'modules'."""
    import equiconvert
    from equiconvert.errors import NotAModuleError

    with pytest.raises(NotAModuleError) as err:
        equiconvert.make_equivariant("resnet18", "C4")
    assert str(err.value) == (
        "make_equivariant takes a module, got 'resnet18': pass one, e.g. torchvision.models.resnet18(); names are "
        "for equiconvert.create_model('torchvision:resnet18')"
    )
    with pytest.raises(NotAModuleError, match="takes a torch.nn.Module, got dict"):
        equiconvert.make_equivariant({"weight": torch.zeros(1)}, "C4")


class _WeightCache(nn.Module):
    """Copies its scale into a buffer, in place, in every forward: state set from a parameter, never from the
    data (the DP-safety probe accepts it), that torch.func's per-example transforms cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.register_buffer("cached", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cached.copy_(self.scale.detach())
        return x * self.scale


@pytest.mark.parametrize("method", ["vmap", "bookkeeping"])
def test_an_in_place_buffer_update_is_one_line_naming_the_module(method):
    """torch.func used to raise its RuntimeError "... would mutate a captured Tensor", naming no module."""
    model = nn.Sequential(nn.Flatten(), _WeightCache(), nn.Linear(SIZE * SIZE, CLASSES))
    with pytest.raises(PrivacyValidationError) as err:
        DPTrainer(model, per_sample_method=method, **OPTIONS).fit(tiny_images())
    message = str(err.value)
    assert re.match(r"module '1' writes its buffer 'cached' in place in its forward \(_WeightCache\)", message)
    assert "\n" not in message and "keep that state out of the forward" in message
