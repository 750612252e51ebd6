"""make_equivariant(mode=...): "dp" restricts to the flips before the last stage and keeps the parameter count."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import equiconvert
from equiconvert.errors import ParameterError
from equiconvert.nn.restriction import FieldRestriction


def small_convnet() -> nn.Module:
    """Opacus' CIFAR-10 example network at half its widths, one stage fewer (ReLU, average pooling, no norm)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip


def convert(model: nn.Module, group: str, **options) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return equiconvert.make_equivariant(model, group, input_size=16, **options)


def test_dp_mode_restricts_to_the_flips_before_the_last_stage_and_keeps_the_parameter_count():
    torch.manual_seed(0)
    original = small_convnet()
    model = convert(original, "D4", mode="dp")
    report = model.report
    assert report.mode == "dp" and "D1" in report.mode_reason
    assert abs(report.params_after - report.params_before) <= 0.02 * report.params_before
    restrictions = [m for m in model.modules() if isinstance(m, FieldRestriction)]
    assert len(restrictions) == 1
    assert equiconvert.check_equivariance(model, input_size=16).max_error < 1e-4  # exact for the flips
    x = torch.randn(4, 3, 16, 16)
    with torch.no_grad():  # the classifier sees orientation: a quarter turn changes the logits
        assert not torch.allclose(model(x), model(torch.rot90(x, 1, (2, 3))), atol=1e-3)
        assert torch.allclose(model(x), model(torch.flip(x, (3,))), atol=1e-4)


def test_the_full_mode_keeps_the_group_and_its_report_points_to_the_dp_mode():
    model = convert(small_convnet(), "D4")
    assert model.report.mode == "full"
    assert not any(isinstance(m, FieldRestriction) for m in model.modules())
    assert "mode='dp'" in str(model.report)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.allclose(model(x), model(torch.rot90(x, 1, (2, 3))), atol=1e-4)


def test_options_given_explicitly_win_over_the_mode():
    original = small_convnet()
    model = convert(original, "D4", mode="dp", width=1.75, restrict="D4->D2")
    assert model.report.width.startswith("kappa")
    assert model.report.params_after > 1.1 * model.report.params_before


def test_groups_without_flips_restrict_to_the_trivial_group_in_dp_mode():
    model = convert(small_convnet(), "C4", mode="dp")
    assert "trivial group" in model.report.mode_reason
    assert sum(isinstance(m, FieldRestriction) for m in model.modules()) <= 1  # C4 -> C1 may be a pure relabelling


def test_a_model_without_a_resolution_drop_keeps_the_full_group_in_dp_mode_and_says_so():
    flat = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)
    )
    model = convert(flat, "D4", mode="dp")
    assert "no resolution drop" in model.report.mode_reason


def test_an_unknown_mode_is_refused_naming_the_parameter():
    with pytest.raises(ParameterError, match=r"mode='fast'.*\['full', 'dp'\]"):
        equiconvert.make_equivariant(small_convnet(), "D4", mode="fast")


def test_dp_mode_takes_the_closest_parameter_count_a_small_model_allows_and_says_how_far_off():
    tiny = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip
    model = convert(tiny, "D4", mode="dp")
    off = abs(model.report.params_after - model.report.params_before) / model.report.params_before
    assert off > 0.02 and f"{off:.1%} off" in model.report.mode_reason
    with pytest.raises(equiconvert.errors.UnsupportedLayerError, match="width='params'"):
        convert(tiny, "D4", mode="dp", width="params")  # asked for by name: the 2% promise holds


def test_the_command_line_converts_in_dp_mode(capsys):
    from equiconvert.cli import main

    assert main(["convert", "equiconvert:small_cnn", "--group", "D4", "--mode", "dp", "--json", "--no-check"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["mode"] == "dp" and "D1" in record["mode_reason"]
