"""check_equivariance refuses non-positive sizes and warns at a size where exactness cannot hold."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

import equiconvert


@pytest.fixture(scope="module")
def model() -> nn.Module:
    """Two stride-2 pools: exact at multiples of 4 only."""
    plain = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1), nn.MaxPool2d(2)
    )
    return equiconvert.make_equivariant(plain, "D4", input_size=16)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"input_size": 0}, "input_size"),
        ({"input_size": -4}, "input_size"),
        ({"input_size": 16.0}, "input_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"in_channels": 0}, "in_channels"),
    ],
)
def test_non_positive_sizes_are_refused(model: nn.Module, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be an int >= 1"):
        equiconvert.check_equivariance(model, **kwargs)


def test_invalid_size_warns_with_the_nearest_valid_sizes(model: nn.Module) -> None:
    assert model.report.valid_input_sizes[:3] == [8, 12, 16]
    with pytest.warns(UserWarning, match=r"input size 15 does not keep exact equivariance.*nearest: 12, 16"):
        result = equiconvert.check_equivariance(model, input_size=15)
    assert result.max_error > 1e-3  # the warning is warranted: the error there is not at float precision


def test_valid_size_does_not_warn(model: nn.Module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert equiconvert.check_equivariance(model, input_size=16).max_error <= 1e-5


def test_images_of_an_inexact_size_warn_once_at_the_forward(model: nn.Module) -> None:
    import torch

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        model(torch.randn(1, 3, 16, 16))  # valid: silent
        model(torch.randn(1, 3, 14, 14))
        model(torch.randn(1, 3, 14, 14))  # the same size again: said once
    messages = [str(w.message) for w in shown if issubclass(w.category, equiconvert.EquivarianceWarning)]
    assert len(messages) == 1 and "14x14" in messages[0] and "[12, 16]" in messages[0]
    assert "pad_to_valid=True" in messages[0]
