"""benchmarks/fuzz_convert.py: seeded hand-written CNNs convert exactly or are refused in one clear line."""

from __future__ import annotations

import json

import pytest

from tests.support.benchmark_scripts import load_benchmark

fuzz = load_benchmark("fuzz_convert")


@pytest.mark.parametrize(
    "seed, drawn",
    [
        (1, "dense +8, head adaptive"),  # the image concatenated beside regular fields
        (15, "head decoder (transposed2)"),  # a UNet with a 2x2 stride-2 transposed conv
        (20, "dense +16, narrow to 18"),  # a narrow through a direct sum
        (5, "narrow to 18, residual"),  # a residual on a direct sum: its conv makes the sum's parts
        (19, "AvgPool2d, head flatten"),  # a flattened 8x8 grid, averaged over D4's turns and flips
    ],
)
def test_seeded_hand_written_networks_convert_exactly(seed, drawn):
    record = fuzz.assess(seed)
    assert drawn in record.network  # the grammar still draws what the seed stands for
    assert record.outcome == "exact", record.message
    assert record.max_error <= fuzz.TOLERANCE and record.params_after > 0


def test_summary_counts_each_outcome_and_names_every_network(tmp_path, capsys):
    out = tmp_path / "fuzz.json"
    summary = fuzz.main(["--count", "2", "--seed", "24", "--out", str(out)])  # 25: a residual on the image itself
    assert json.loads(out.read_text()) == summary == json.loads(capsys.readouterr().out)
    assert summary["networks"] == 2 and sum(summary["counts"].values()) == 2
    assert summary["counts"]["exact"] == 2 and summary["exact_share"] == 1.0
    assert [r["seed"] for r in summary["records"]] == [24, 25] and "residual" in summary["records"][1]["network"]
