"""Pretrained weights: the builders pass them through, and conversion says which layers keep them."""

import json

import pytest
import timm
import torch
import torchvision
from torch import nn

import equiconvert
from equiconvert import cli
from equiconvert.errors import ModelNameError
from equiconvert.convert.weights import weight_transfer


@pytest.fixture
def fake_torchvision_weights(monkeypatch):
    """torchvision.models.get_model, with "downloaded" weights of 0.25 everywhere (no network in tests)."""
    real = torchvision.models.get_model
    calls = []

    def get_model(name, **kwargs):
        calls.append(kwargs)
        if kwargs.get("weights") is None:
            return real(name, **kwargs)
        model = real(name)  # the pretrained classifier: 1000 classes
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.25)
        return model

    monkeypatch.setattr(torchvision.models, "get_model", get_model)
    return calls


def test_torchvision_builder_loads_the_weights_and_keeps_a_new_head_fresh(fake_torchvision_weights):
    model = equiconvert.create_model("torchvision:resnet18", num_classes=10, pretrained="IMAGENET1K_V1")
    assert {"weights": "IMAGENET1K_V1"} in fake_torchvision_weights
    assert bool((model.conv1.weight == 0.25).all()) and bool((model.layer4[1].bn2.bias == 0.25).all())
    assert model.fc.out_features == 10 and not bool((model.fc.weight == 0.25).any())
    equiconvert.create_model("torchvision:resnet18", pretrained=True)
    assert fake_torchvision_weights[-1] == {"weights": "DEFAULT"}


def test_timm_builder_passes_pretrained_and_refuses_a_weights_name(monkeypatch):
    calls = []
    monkeypatch.setattr(timm, "create_model", lambda name, **kwargs: calls.append(kwargs) or nn.Conv2d(3, 3, 1))
    equiconvert.create_model("timm:resnet18", num_classes=7, pretrained=True)
    assert calls == [{"pretrained": True, "num_classes": 7}]
    with pytest.raises(ModelNameError, match=r"timm:resnet18.<tag>"):
        equiconvert.create_model("timm:resnet18", pretrained="a1_in1k")
    with pytest.raises(ModelNameError, match="no pretrained weights"):
        equiconvert.create_model("equiconvert:resnet9", pretrained=True)


def test_conversion_of_a_pretrained_model_warns_and_lists_the_layers():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    with pytest.warns(
        UserWarning, match=r"do not carry over to 3 of its 3 parametrised layers.*kept their weights: none"
    ):
        converted = equiconvert.make_equivariant(model, "C4", head="invariant", pretrained=True)
    report = converted.report
    assert report.weights_kept == [] and report.weights_reinitialised == ["0", "1", "5"]
    assert f"warning: {report.weights_warning}" in str(report)
    assert json.loads(report.to_json())["weights_reinitialised"] == ["0", "1", "5"]
    untouched = equiconvert.make_equivariant(model, "C4", head="invariant")
    assert untouched.report.weights_warning is None and untouched.report.weights_kept is None


def test_weight_transfer_keeps_layers_with_the_same_name_shape_and_values():
    original = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 2))
    converted = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(4, 2))
    converted[1].load_state_dict(original[1].state_dict())
    assert weight_transfer(original, converted) == (["1"], ["0"])
    with torch.no_grad():
        converted[1].bias.add_(1)
    assert weight_transfer(original, converted) == ([], ["0", "1"])


def test_convert_cli_pretrained_flag(fake_torchvision_weights, capsys):
    with pytest.warns(UserWarning, match="freshly initialised"):
        assert (
            cli.main(["convert", "torchvision:resnet18", "--group", "C4", "--pretrained", "--no-check", "--json"]) == 0
        )
    data = json.loads(capsys.readouterr().out)
    assert fake_torchvision_weights[-1] == {"weights": "DEFAULT"}
    assert data["weights_kept"] == [] and "conv1" in data["weights_reinitialised"]
    assert "freshly initialised" in data["weights_warning"]
