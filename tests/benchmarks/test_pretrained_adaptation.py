"""benchmarks/pretrained_adaptation.py --tiny: pretraining, three private fine-tunings at one budget, JSON summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.benchmark_scripts import load_benchmark

FASHION = Path("/usr/share/datasets/fashion-mnist")
MNIST = Path("/work/shared/data/mnist-10k.npz")


@pytest.mark.slow  # about a minute on two CPU cores: mostly DP-SGD's probes and the accountant
@pytest.mark.skipif(not (FASHION.is_dir() and MNIST.is_file()), reason=f"needs Fashion-MNIST in {FASHION} and {MNIST}")
def test_tiny_run_fine_tunes_three_models_privately_and_the_canonicalised_one_is_invariant(tmp_path):
    out = tmp_path / "summary.json"
    args = ["--tiny", "--group", "D4", "--fashion-dir", str(FASHION), "--mnist", str(MNIST), "--out", str(out)]
    assert load_benchmark("pretrained_adaptation").main(args) == 0
    summary = json.loads(out.read_text())
    assert summary["tiny"] and summary["group"] == "D4" and summary["noise_multiplier"] > 0
    results = summary["results"]
    assert set(results) == {"scratch_converted", "pretrained", "pretrained_canonicalized"}
    for name, result in results.items():
        assert result["steps"] == 2 and 0 < result["epsilon"] <= summary["target_epsilon"], name
        assert 0 <= result["upright_accuracy"] <= 1 and 0 <= result["turned_accuracy"] <= 1, name
    # both invariant models score the turned digits exactly as the upright ones
    for name in ("scratch_converted", "pretrained_canonicalized"):
        assert results[name]["turned_accuracy"] == results[name]["upright_accuracy"], name
    assert results["pretrained_canonicalized"]["parameters"] > results["pretrained"]["parameters"]
