"""A model that no input size makes exactly equivariant is refused by default, naming the layers that break it;
allow_non_equivariant keeps it with a real Python warning, and every report warning is a Python warning too."""

import json
import pickle
import warnings

import pytest
from torch import nn

import equiconvert
from equiconvert import EquivarianceBreakError, EquivarianceWarning
from equiconvert.cli import main
from equiconvert.errors import InvalidInputSizeError
from equiconvert.models import register_model
from equiconvert.models._registry import _MODELS


class _NoExactSize(nn.Module):
    """A stride-2 3x3 conv (symmetric windows on odd sizes only) beside a 2x2 pool (even sizes only), as in dla34."""

    def __init__(self, num_classes: int = 2, in_channels: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 8, 3, stride=2, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.skip = nn.Conv2d(in_channels, 8, 1)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        return self.fc(self.gap(self.conv(x) + self.skip(self.pool(x))).flatten(1))


BREAKS = r"node 'conv' \(module 'conv'\) places its windows asymmetrically.*node 'pool' \(module 'pool'\)"


def test_a_model_exact_at_no_size_is_refused_naming_the_layers_and_the_option():
    with pytest.raises(EquivarianceBreakError, match=f"no size from 8 to 1024.*{BREAKS}.*allow_non_equivariant=True"):
        equiconvert.make_equivariant(_NoExactSize(), "C4", head="invariant")


def test_allow_non_equivariant_keeps_it_with_a_python_warning_naming_the_layer():
    with pytest.warns(EquivarianceWarning, match=f"{BREAKS}.*equivariant only approximately") as caught:
        model = equiconvert.make_equivariant(_NoExactSize(), "C4", head="invariant", allow_non_equivariant=True)
    issued = [w.message for w in caught if w.category is EquivarianceWarning]
    assert issued == model.report.warnings and isinstance(issued[0], UserWarning)
    assert (
        issued[0].node == "conv" and issued[0].module_path == "conv" and "test_non_equivariant.py" in issued[0].source
    )
    assert model.report.valid_input_sizes == []
    with pytest.warns(UserWarning, match="does not keep exact equivariance"):
        assert equiconvert.check_equivariance(model, input_size=32).max_error > 1e-3  # it really is not equivariant


def test_a_size_to_fit_needs_a_valid_one_even_when_non_equivariance_is_allowed():
    with pytest.raises(InvalidInputSizeError, match="nearest: none"):
        equiconvert.make_equivariant(
            _NoExactSize(), "C4", head="invariant", input_size=64, pad_to_valid=True, allow_non_equivariant=True
        )


def test_strict_and_allow_non_equivariant_together_are_refused_before_converting():
    with pytest.raises(ValueError, match="give strict or allow_non_equivariant, not both"):
        equiconvert.make_equivariant(nn.Linear(2, 2), "C4", strict=True, allow_non_equivariant=True)


def test_every_report_warning_is_issued_as_a_python_warning_that_a_filter_can_make_an_error():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=(1, 0)))
    with pytest.warns(EquivarianceWarning, match=r"node '_0' \(module '0'\).*padding=\(1, 0\)"):
        converted = equiconvert.make_equivariant(model, "C4", input_size=16)
    assert len(converted.report.warnings) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", EquivarianceWarning)
        with pytest.raises(EquivarianceWarning, match="padding"):
            equiconvert.make_equivariant(model, "C4", input_size=16)


def test_an_equivariance_warning_survives_pickling_and_json():
    warning = EquivarianceWarning("conv", "layer1.conv", "net.py:3", "breaks it")
    assert pickle.loads(pickle.dumps(warning)) == warning and str(warning) == (
        "node 'conv' (module 'layer1.conv') at net.py:3: breaks it"
    )
    report = equiconvert.ConversionReport(group="C4", width="kappa", warnings=[warning])
    (record,) = json.loads(report.to_json())["warnings"]
    assert record == {**warning.to_dict(), "text": str(warning)} and record["node"] == "conv"


@pytest.fixture
def registered_no_exact_size():
    register_model(name="no_exact_size_net")(_NoExactSize)
    yield "no_exact_size_net"
    _MODELS.pop("no_exact_size_net")


def test_cli_refuses_it_in_one_line_and_keeps_it_with_the_flag(registered_no_exact_size, capsys):
    assert main(["convert", registered_no_exact_size, "--group", "C4", "--head", "invariant", "--no-check"]) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "node 'conv'" in err[0] and "--allow-non-equivariant" in err[0]
    argv = ["convert", registered_no_exact_size, "--group", "C4", "--head", "invariant", "--no-check", "--json"]
    with pytest.warns(EquivarianceWarning, match="node 'conv'"):
        assert main([*argv, "--allow-non-equivariant"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["valid_input_sizes"] == [] and record["warnings"][0]["node"] == "conv"
    with pytest.raises(SystemExit):
        main([*argv, "--allow-non-equivariant", "--strict"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_saved_model_kept_with_allow_non_equivariant_loads_again(registered_no_exact_size, tmp_path):
    with pytest.warns(EquivarianceWarning):
        model = equiconvert.make_equivariant(
            equiconvert.create_model(registered_no_exact_size), "C4", head="invariant", allow_non_equivariant=True
        )
    equiconvert.save(model, tmp_path / "model.pt")
    with pytest.warns(EquivarianceWarning, match="node 'conv'"):
        loaded = equiconvert.load(tmp_path / "model.pt")
    assert loaded.report.valid_input_sizes == []
