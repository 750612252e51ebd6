"""Blank rows pad a step's last physical batch to a multiple of physical_batch_multiple and change nothing: the noisy
gradient, loss and non-finite count of a padded step equal the unpadded step's, for every per-example back-end."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from equiconvert.training.chunk_padding import (
    PADDING_LABEL,
    ignoring_blank_rows,
    pad_with_blank_rows,
    padded_size,
)
from equiconvert.training.devices import cudnn_autotuning
from equiconvert.training.dp_config import ConfigError, DPConfig, check_config
from equiconvert.training.hooks import cross_entropy
from equiconvert.training.trainer import DPTrainer


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    )


class _NaNOnBlankViews(nn.Module):
    """_model() on each view divided by its norm: NaN forward and backward on an all-zero view, finite elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()

    def forward(self, views: torch.Tensor) -> torch.Tensor:
        return self.body(views / views.flatten(1).norm(dim=1).view(-1, 1, 1, 1))


def _data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=generator),
        torch.randint(0, 3, (n,), generator=generator),
    )


def test_padded_size_and_blank_rows():
    assert [padded_size(rows, 4) for rows in (1, 4, 5, 8)] == [4, 4, 8, 8]
    images, labels = torch.ones(5, 3, 2, 2), torch.tensor([0, 1, 2, 1, 0])
    padded_images, padded_labels = pad_with_blank_rows(images, labels, 4)
    assert padded_images.shape == (8, 3, 2, 2) and torch.equal(padded_images[:5], images)
    assert not padded_images[5:].any()
    assert padded_labels.tolist() == [0, 1, 2, 1, 0, PADDING_LABEL, PADDING_LABEL, PADDING_LABEL]
    same_images, same_labels = pad_with_blank_rows(images[:4], labels[:4], 4)
    assert torch.equal(same_images, images[:4]) and same_labels.tolist() == [0, 1, 2, 1]  # nothing to add


def test_a_blank_rows_loss_and_its_gradient_are_exactly_zero_and_real_rows_keep_theirs():
    logits = torch.randn(4, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([2, PADDING_LABEL, 0, PADDING_LABEL])
    losses = ignoring_blank_rows(cross_entropy)(logits, labels)
    (grad,) = torch.autograd.grad(losses.sum(), logits)
    expected = F.cross_entropy(logits[[0, 2]], labels[[0, 2]], reduction="none")
    torch.testing.assert_close(losses[[0, 2]], expected, rtol=0, atol=0)
    assert losses[[1, 3]].tolist() == [0.0, 0.0]
    assert not grad[[1, 3]].any() and grad[[0, 2]].abs().sum() > 0


def _step(
    method: str, multiple: int, rows: list[int], model: Callable[[], nn.Module] = _model, zero_images: int = 0
) -> tuple:
    """One step's noisy gradient, batch size, loss and non-finite count; `rows` receives each physical batch's rows.
    The first `zero_images` images are all zero, and so are their views (normalize_mean 0)."""
    torch.manual_seed(0)
    trainer = DPTrainer(
        model(),
        device="cpu",
        progress=False,
        per_sample_method=method,
        batch_size=21,
        physical_batch_size=8,
        physical_batch_multiple=multiple,
        aug_mult=2,
        noise_multiplier=1.0,
        max_grad_norm=0.05,  # every example clipped: a blank row counted as a real one would show in the sum
        normalize_mean=0.0,
        steps=1,
        insecure_seeded_noise=True,  # both runs draw the same sample and the same noise
    )
    accumulate = trainer._per_sample_gradients.accumulate_clipped

    def recording(params, buffers, views, *args, **kwargs):
        rows.append(views.shape[0])
        return accumulate(params, buffers, views, *args, **kwargs)

    trainer._per_sample_gradients.accumulate_clipped = recording
    images, labels = _data()
    images[:zero_images] = 0
    trainer._prepare_privacy(len(labels))
    return trainer._noisy_gradient(images, labels)


@pytest.mark.parametrize("method", ["bookkeeping", "vmap", "ghost"])
def test_blank_rows_leave_the_noisy_gradient_the_loss_and_the_counts_unchanged(method):
    plain_rows: list[int] = []
    padded_rows: list[int] = []
    gradient, count, loss, nonfinite = _step(method, 1, plain_rows)
    padded_gradient, padded_count, padded_loss, padded_nonfinite = _step(method, 4, padded_rows)
    assert sum(plain_rows) == int(count) and sum(padded_rows) > sum(plain_rows)  # the last batch was padded
    assert all(rows % 4 == 0 for rows in padded_rows)
    assert padded_rows[:-1] == plain_rows[:-1] and padded_rows[-1] == padded_size(plain_rows[-1], 4)
    assert int(padded_count) == int(count) and int(padded_nonfinite) == int(nonfinite) == 0
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=1e-7)
    assert gradient.keys() == padded_gradient.keys()
    for name in gradient:
        torch.testing.assert_close(padded_gradient[name], gradient[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("zero_images", [0, 16])
@pytest.mark.parametrize("method", ["bookkeeping", "vmap", "ghost"])
def test_blank_rows_of_a_model_that_is_nan_on_zeros_are_not_counted_as_non_finite(method, zero_images):
    """A model that is NaN on an all-zero input gives NaN per-example gradients for blank rows; the padded step
    counts only the real non-finite examples (the all-zero real images), and its noisy gradient is unchanged."""
    plain_rows: list[int] = []
    padded_rows: list[int] = []
    gradient, count, loss, nonfinite = _step(method, 1, plain_rows, _NaNOnBlankViews, zero_images)
    padded = _step(method, 4, padded_rows, _NaNOnBlankViews, zero_images)
    padded_gradient, padded_count, padded_loss, padded_nonfinite = padded
    assert sum(padded_rows) > sum(plain_rows) == int(count) == int(padded_count)  # the last batch was padded
    assert int(padded_nonfinite) == int(nonfinite)
    assert (int(nonfinite) > 0) == (zero_images > 0)  # a real all-zero image is still counted
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert gradient.keys() == padded_gradient.keys()
    for name in gradient:
        assert torch.isfinite(padded_gradient[name]).all()
        torch.testing.assert_close(padded_gradient[name], gradient[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("multiple", [0, 3, 16])
def test_a_multiple_that_does_not_divide_the_physical_batch_is_refused_by_name(multiple):
    with pytest.raises(ConfigError, match="physical_batch_multiple"):
        check_config(DPConfig(physical_batch_size=8, physical_batch_multiple=multiple))


def test_cudnn_autotuning_is_on_inside_and_restored_after():
    before = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = False
        with cudnn_autotuning(True):
            assert torch.backends.cudnn.benchmark
        assert not torch.backends.cudnn.benchmark
        with cudnn_autotuning(False):
            assert not torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = before
