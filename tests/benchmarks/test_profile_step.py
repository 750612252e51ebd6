"""benchmarks/profile_step.py: the step's phases are found and reported for both methods."""

import json

from tests.support.benchmark_scripts import load_benchmark


def test_profile_reports_the_dp_steps_phases(tmp_path):
    out = tmp_path / "profile.json"
    profile_step = load_benchmark("profile_step")
    assert (
        profile_step.main(
            ["--device", "cpu", "--batch", "2", "--aug-mult", "2", "--steps", "1", "--top", "3", "--out", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    phases = report["results"]["bookkeeping"]["phases"]
    expected = {
        "equiconvert/forward",
        "equiconvert/backward",
        "equiconvert/per_example/SteerableConv2d",
        "equiconvert/per_example/Linear",
        "equiconvert/clip_and_sum",
    }
    assert set(phases) == expected  # no "other" on CPU: the rest is only defined for device kernels
    assert all(phase["cpu_ms"] > 0 for phase in phases.values())
    assert report["results"]["nonprivate"]["phases"] == {}  # the non-private step runs none of book-keeping's code
    assert report["device"] == "cpu" and report["batch"] == 2


def test_profile_of_the_plain_wrn_finds_its_conv_and_norm_layers(tmp_path):
    out = tmp_path / "profile.json"
    argv = ["--device", "cpu", "--model", "wrn16_4", "--batch", "2", "--aug-mult", "2", "--steps", "1", "--top", "3"]
    assert load_benchmark("profile_step").main([*argv, "--out", str(out)]) == 0
    phases = json.loads(out.read_text())["results"]["bookkeeping"]["phases"]
    assert {"equiconvert/per_example/Conv2d", "equiconvert/per_example/GroupNorm"} <= set(phases)
    assert "equiconvert/per_example/SteerableConv2d" not in phases
