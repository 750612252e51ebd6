"""benchmarks/init_scale.py: the signal scale at initialisation, per layer, and a learning-rate sweep, as JSON."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tests.support.benchmark_scripts import load_benchmark


def test_tiny_run_reports_scales_layers_and_the_sweep(tmp_path, capsys):
    out = tmp_path / "init_scale.json"
    assert load_benchmark("init_scale").main(["--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    init = report["init"]
    assert set(init) == {"none", "C4", "SO2"} and report["settings"]["unit_invariants"] is True
    seeds = report["settings"]["seeds"]
    for row in init.values():
        assert row["logit_std"] > 0 and math.isfinite(row["loss"])
        assert len(row["logit_std_runs"]) == len(row["loss_runs"]) == seeds  # each seed's, for a median
        assert math.isclose(statistics.mean(row["logit_std_runs"]), row["logit_std"])
        assert math.isclose(statistics.mean(row["loss_runs"]), row["loss"])
        assert "stem.0" in row["layer_std"] and "head.2" in row["layer_std"]  # the converted names lose "network."
    assert any("group_pool" in name for name in init["C4"]["layer_std"])
    assert set(report["lr_sweep"]) == {"none", "C4"}
    for runs in report["lr_sweep"].values():
        assert set(runs) == {"0.05"} and 0.0 <= runs["0.05"]["accuracy"] <= 1.0


@pytest.mark.parametrize("flag", ["--seeds", "--steps", "--examples"])
def test_a_count_below_one_is_refused_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark("init_scale").main([flag, "0"])
    assert exit_info.value.code == 2 and f"{flag} must be >= 1" in capsys.readouterr().err
