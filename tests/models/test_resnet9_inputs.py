"""ResNet9 refuses bad widths and activations up front, naming the keyword."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from equiconvert.models import create_model, resnet9
from equiconvert.models.resnet9 import ACTIVATIONS
from equiconvert.recipes.recipe import parse_kwargs


@pytest.mark.parametrize("widths", [(0, 8, 8), (-4, 8, 8), (4, 8.5, 8), (4, True, 8), "488"])
def test_bad_widths_name_the_keyword(widths: object) -> None:
    with pytest.raises(ValueError, match="widths"):
        resnet9(widths=widths)


def test_widths_from_model_kwargs() -> None:
    with pytest.raises(ValueError, match=r"widths must be 3 ints >= 1"):
        create_model("equiconvert:resnet9", **parse_kwargs("widths=0,8,8"))
    model = create_model("equiconvert:resnet9", **parse_kwargs("widths=2,4,4"))
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)


@pytest.mark.parametrize("name,cls", [("gelu", nn.GELU), ("relu", nn.ReLU), ("SiLU", nn.SiLU), ("mish", nn.Mish)])
def test_activation_by_name(name: str, cls: type[nn.Module]) -> None:
    model = create_model("equiconvert:resnet9", widths=(2, 4, 4), **parse_kwargs(f"act={name}"))
    assert sum(isinstance(m, cls) for m in model.modules()) == 8
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)


@pytest.mark.parametrize("act", ["swishy", 3])
def test_unknown_activation_lists_the_names(act: object) -> None:
    with pytest.raises(ValueError, match=r"act .*gelu.*relu") as info:
        resnet9(widths=(2, 4, 4), act=act)
    assert all(name in str(info.value) for name in ACTIVATIONS)
