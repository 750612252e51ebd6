"""Progress bars of conversion, basis builds and equivariance checks: drawn when asked or on a terminal, never in logs."""

from __future__ import annotations

import pytest
from torch import nn

from equiconvert import basis, check_equivariance, make_equivariant, progress
from equiconvert import check
from equiconvert.convert import core
from equiconvert.convert.trace import trace
from equiconvert.errors import ParameterError

GROUP = "C4"


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


@pytest.fixture
def no_delay(monkeypatch) -> dict:
    """Bars drawn at once (the conversion of a small model is shorter than DELAY_S); returns the last bar of each
    description (drawn or not)."""
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    made = {}

    def recorded(desc, *args, **kwargs):
        made[desc] = real(desc, *args, **kwargs)
        return made[desc]

    real = progress.progress_bar
    for module in (progress, core, check):
        monkeypatch.setattr(module, "progress_bar", recorded)
    monkeypatch.setattr(basis, "_memory_cache", {})  # every basis is built (the package runs without a disk cache)
    return made


def test_conversion_draws_a_bar_per_node_and_counts_the_bases_built(no_delay, capsys):
    model = small_cnn()
    nodes = len(trace(model, ()).graph.nodes)
    converted = make_equivariant(model, GROUP, input_size=9, progress=True)
    err = capsys.readouterr().err
    # each node rewritten, then each node of the converted graph run at the traced size (9) and at a valid one (32)
    total = nodes + 2 * len(converted.network.graph.nodes)
    assert "converting: " in err and "bases built: " in err  # drawn (tqdm redraws at most every 0.1 s)
    assert no_delay["converting"].n == no_delay["converting"].total == total
    assert no_delay["bases built"].n == len(basis._memory_cache) >= 2  # one per (in, out) field pair the convs need


def test_the_equivariance_check_draws_a_bar_per_element_and_angle(no_delay, capsys):
    converted = make_equivariant(small_cnn(), GROUP, input_size=9, progress=False)
    assert capsys.readouterr().err == ""
    check_equivariance(converted, progress=True, angles=(30.0,))
    assert "equivariance check" in capsys.readouterr().err
    bar = no_delay["equivariance check"]
    assert bar.n == bar.total == len(converted.group.grid_elements) + 1


def test_auto_progress_writes_nothing_when_stderr_is_not_a_terminal(no_delay, capsys):
    converted = make_equivariant(small_cnn(), GROUP, input_size=9)
    check_equivariance(converted)
    assert set(no_delay) == {"converting", "bases built", "equivariance check"}  # made, and silent
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("call", [make_equivariant, check_equivariance])
def test_progress_must_be_a_bool_or_none(call):
    with pytest.raises(ParameterError, match=f"{call.__name__}: progress must be True, False or None"):
        call(small_cnn(), GROUP, progress="no")
