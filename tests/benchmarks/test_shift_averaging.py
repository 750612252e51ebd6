"""benchmarks/shift_averaging.py re-evaluates a run's checkpoint as `equiconvert train --test-shifts` did."""

from __future__ import annotations

import json

import pytest

from equiconvert.cli import main as cli
from tests.support.benchmark_scripts import load_benchmark
from tests.support.train_args import tiny_train_args


def test_checkpoint_reevaluation_matches_the_runs_own_plain_and_shift_averaged_metrics(tmp_path, capsys):
    run = tmp_path / "run"
    args = tiny_train_args(
        run,
        *("--set", "schedule.ema_decay=0.15", "--set", "schedule.checkpoint_every=1"),
        *("--set", "data.test_shifts=grid1"),
        *("--set", "data.normalize_mean=0.4", "--set", "data.normalize_std=0.3"),
        model="equiconvert:equivariant_resnet9",
        group="D1",
        steps=2,
    )
    assert cli(args) == 0
    result = json.loads((run / "result.json").read_text())
    capsys.readouterr()
    out = tmp_path / "shifts.json"
    assert (
        load_benchmark("shift_averaging").main(
            ["--checkpoint", str(run / "checkpoint.pt"), "--group", "D1", "--dataset", "synthetic", "--out", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["step"] == 2 and report["examples"] == result["test_examples"]
    assert report["plain"]["accuracy"] == result["test_accuracy"]
    assert report["plain"]["loss"] == pytest.approx(result["test_loss"], rel=1e-5)
    grid = report["shift_averaged"]["grid1"]
    assert grid["accuracy"] == result["test_accuracy_shift_averaged"]
    assert grid["loss"] == pytest.approx(result["test_loss_shift_averaged"], rel=1e-5)
    assert set(report["shift_averaged"]) == {"cross1", "grid1"}
    assert report["shift_averaged"]["cross1"]["loss"] != pytest.approx(grid["loss"], rel=1e-9)
