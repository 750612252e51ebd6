"""Sizes and counts that cannot describe an image or a model are refused before any tracing."""

import pytest
from torch import nn

from equiconvert import make_equivariant
from equiconvert.cli import main


@pytest.mark.parametrize("size", [0, -8, 32.0, True])
def test_make_equivariant_refuses_an_input_size_that_is_not_a_positive_int(size):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    with pytest.raises(ValueError, match=rf"input_size must be a positive int .*got {size!r}"):
        make_equivariant(model, "D4", input_size=size)


@pytest.mark.parametrize("flag, value", [("--num-classes", "0"), ("--in-channels", "0"), ("--input-size", "-5")])
def test_convert_cli_refuses_counts_and_sizes_below_one_naming_the_flag(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(["convert", "equiconvert:resnet9", "--group", "D4", flag, value])
    assert exit_.value.code == 2 and f"argument {flag}: {value} must be >= 1" in capsys.readouterr().err


def test_probing_sizes_prints_no_tracebacks_and_names_each_root_cause(capsys):
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 5 * 5, 10))  # takes 7x7 inputs only
    with pytest.raises(Exception, match=r"224: RuntimeError: mat1 and mat2 shapes cannot be multiplied") as caught:
        make_equivariant(model, "D4")
    assert "Traceback" not in capsys.readouterr().err and "tensor_meta" not in str(caught.value)
