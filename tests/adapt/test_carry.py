"""carry_weights: a converted model set to the group average of its pretrained CNN, what it measures, what it refuses."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

import equiconvert
from equiconvert.adapt.carry import APPROXIMATE, EXACT, CarryError
from equiconvert.errors import EquiconvertError, UsageError
from equiconvert.groups import parse_group

SIZE = 11  # valid for one stride-2 layer: H = 3 mod 4
CARRY_CONFIG = {"invariant_pool": "mean", "unit_invariants": False, "basis_cutoff": 5.0}


class Tiny(nn.Module):
    """Lifting conv (bias), a hidden strided conv without bias, an optional norm, max pooling, a linear head."""

    def __init__(self, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False),
            *([norm] if norm is not None else []),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def _convert(
    model: nn.Module, group: str, width=lambda channels, group: channels, size: int = SIZE, **config
) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report's note that pretrained weights do not survive conversion
        return equiconvert.make_equivariant(
            model,
            group,
            width=width,
            head="invariant",
            input_size=size,
            pad_to_valid=size != SIZE,
            config={**CARRY_CONFIG, **config},
        )


def _pretrained(norm: nn.Module | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = Tiny(norm)
    with torch.no_grad():  # nonzero biases and norm affines, so that carrying them is tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "features.3" in name:
                p.uniform_(-0.5, 0.5)
    return model.eval()


def _images(count: int = 3) -> torch.Tensor:
    return torch.randn(count, 2, SIZE, SIZE, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("group", ["C4", "D4"])
def test_carried_model_computes_the_group_average_of_the_pretrained_logits_and_is_invariant(group):
    pretrained = _pretrained()
    before = copy.deepcopy(pretrained.state_dict())
    converted = _convert(pretrained, group)
    x = _images()
    report = equiconvert.carry_weights(pretrained, converted, x)

    elements = parse_group(group).grid_elements
    with torch.no_grad():
        average = torch.stack([pretrained(g.act_on_grid(x)) for g in elements]).mean(0)
        logits = converted.eval()(x)
        turned = [converted(g.act_on_grid(x)) for g in elements]
    assert torch.allclose(logits, average, atol=1e-5, rtol=0)
    assert not torch.allclose(logits, pretrained(x), atol=1e-3)  # the average, not the pretrained model itself
    assert max(float((y - logits).abs().max()) for y in turned) < 1e-5
    assert report.exact and report.logit_error < 1e-5 and report.logit_scale > 0.1
    assert [(layer.name, layer.status) for layer in report.layers] == [
        ("features.0", EXACT),
        ("features.2", EXACT),
        ("head", EXACT),
    ]
    assert all(torch.equal(before[k], v) for k, v in pretrained.state_dict().items())  # the pretrained model untouched


@pytest.mark.parametrize("norm", [nn.GroupNorm(2, 6), nn.BatchNorm2d(6)], ids=["GroupNorm", "BatchNorm"])
def test_a_norm_layer_carries_its_affine_and_the_logit_error_is_measured(norm):
    pretrained = _pretrained(norm)
    if isinstance(norm, nn.BatchNorm2d):
        norm.running_mean.uniform_(-1, 1), norm.running_var.uniform_(0.5, 2)
    converted = _convert(pretrained, "C4")
    x = _images()
    report = equiconvert.carry_weights(pretrained, converted, x)

    statuses = {layer.name: layer.status for layer in report.layers}
    assert statuses == {"features.0": EXACT, "features.2": EXACT, "features.3": APPROXIMATE, "head": EXACT}
    assert not report.exact
    carried = converted.network.get_submodule("features.3")
    assert torch.equal(carried.weight, norm.weight) and torch.equal(carried.bias, norm.bias)
    with torch.no_grad():
        average = torch.stack([pretrained(g.act_on_grid(x)) for g in parse_group("C4").grid_elements]).mean(0)
        error = float((converted(x) - average).abs().max())
    assert math.isfinite(report.logit_error) and report.logit_error > 1e-4
    assert report.logit_error == pytest.approx(error, rel=1e-5)


@pytest.mark.parametrize("group", ["C4", "D4"])
def test_the_report_counts_parameters_and_multiply_adds_of_both_models(group):
    pretrained = _pretrained()
    converted = _convert(pretrained, group)
    report = equiconvert.carry_weights(pretrained, converted, _images(2))
    order = parse_group(group).order
    out_1, out_2 = SIZE * SIZE, 6 * 6  # positions of the two conv outputs (stride 2 from 11: 6)
    macs = 4 * out_1 * 2 * 9 + 6 * out_2 * 4 * 9 + 3 * 6
    assert report.pretrained_cost.multiply_adds == macs
    # lifting: |G| copies; hidden conv: |G| x |G| channels (the block-diagonal filter runs dense); head unchanged
    assert report.carried_cost.multiply_adds == order * 4 * out_1 * 2 * 9 + order**2 * 6 * out_2 * 4 * 9 + 3 * 6
    assert report.pretrained_cost.parameters == sum(p.numel() for p in pretrained.parameters())
    assert report.carried_cost.parameters == sum(p.numel() for p in converted.parameters())
    assert report.carried_cost.activations == order * (4 * out_1 + 6 * out_2) + 3


def test_a_basis_that_does_not_span_the_filters_is_reported_with_its_residual():
    pretrained = _pretrained()
    converted = _convert(pretrained, "C4", basis_cutoff=None)  # escnn's default band limit: 6 of the 9 lifting filters
    report = equiconvert.carry_weights(pretrained, converted, _images())
    conv = report.layers[0]
    assert conv.status == APPROXIMATE and 0.1 < conv.residual < 1 and "basis_cutoff" in conv.note
    assert report.logit_error > 1e-3


def test_the_default_probe_measures_on_the_converted_models_input_size():
    pretrained = _pretrained()
    report = equiconvert.carry_weights(pretrained, _convert(pretrained, "C4"))
    assert report.logit_error < 1e-5 and report.logit_scale > 0.1


def test_a_padded_input_is_compared_with_the_pretrained_model_on_the_padded_images():
    pretrained = _pretrained()
    converted = _convert(pretrained, "C4", size=9)  # fitted to 11 by the converted network's input fit
    report = equiconvert.carry_weights(pretrained, converted)
    assert converted.report.input_fit is not None
    assert report.exact and report.logit_error < 1e-5 and report.logit_scale > 0.1


@pytest.mark.parametrize(
    "options, module",
    [
        (dict(width="kappa"), "features.0"),
        (dict(invariant_pool="max"), "equiconvert_group_pool"),
        (dict(unit_invariants=True), "equiconvert_group_pool"),
        (dict(weight_standardization=True), "features.0"),
    ],
    ids=["width", "max pooling", "scaled pooling", "weight standardization"],
)
def test_a_conversion_the_weights_cannot_carry_through_is_refused_naming_the_module(options, module):
    pretrained = _pretrained()
    converted = _convert(pretrained, "C4", **options)
    with pytest.raises(CarryError, match=f"^{module}.*width=lambda channels, group: channels") as info:
        equiconvert.carry_weights(pretrained, converted)
    assert isinstance(info.value, EquiconvertError) and "\n" not in str(info.value)


def test_a_group_with_elements_off_the_pixel_grid_and_a_plain_module_are_refused():
    pretrained = _pretrained()
    with pytest.raises(CarryError, match="^group C8: .*C4, D1, D2, D4"):
        equiconvert.carry_weights(pretrained, _convert(pretrained, "C8"))
    with pytest.raises(UsageError, match="^converted must be the EquivariantModel"):
        equiconvert.carry_weights(pretrained, pretrained)


def test_a_pretrained_layer_of_another_kind_is_refused_naming_it():
    pretrained = _pretrained()
    converted = _convert(pretrained, "C4")
    other = copy.deepcopy(pretrained)
    other.head = nn.Linear(6, 5)  # a head of another shape than the converted one
    with pytest.raises(CarryError, match="^head: the linear layer"):
        equiconvert.carry_weights(other, converted)
