"""benchmarks/pose_transfer.py: a canonicaliser taught on public images, its identity-pose share per split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.benchmark_scripts import load_benchmark

FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not FASHION.is_dir(), reason=f"needs Fashion-MNIST in {FASHION}")
def test_teaching_raises_the_public_identity_share_and_the_summary_has_a_median_row_per_setting(tmp_path):
    out = tmp_path / "pose.json"
    args = ["--fashion-dir", str(FASHION), "--fields", "2", "--pose-steps", "0,400", "--seeds", "0,1"]
    assert load_benchmark("pose_transfer").main([*args, "--test-examples", "256", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["task"] == "fashion_split" and summary["group"] == "C4" and len(summary["runs"]) == 4
    untaught, taught = summary["table"]
    assert (untaught["pose_steps"], taught["pose_steps"]) == (0, 400) and taught["seeds"] == [0, 1]
    for row in (untaught, taught):
        runs = [r for r in summary["runs"] if r["pose_steps"] == row["pose_steps"]]
        for key in ("public_identity_share", "private_identity_share"):
            assert row[key] == pytest.approx(sum(r[key] for r in runs) / 2)  # the median of two
            assert 0 <= row[key] <= 1
    # teaching moves the public images toward the identity pose (untaught: whatever pose its initial weights favour)
    assert taught["public_identity_share"] > untaught["public_identity_share"] + 0.1


def test_bad_lists_are_refused_with_the_flags_named(capsys):
    module = load_benchmark("pose_transfer")
    with pytest.raises(SystemExit):
        module.parse_args(["--fields", "2,x"])
    assert "--fields, --pose-steps and --seeds take comma-separated whole numbers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.parse_args(["--fields", "0"])
    assert "--fields and --test-examples must be >= 1" in capsys.readouterr().err
