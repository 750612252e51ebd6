"""The main job (`equiconvert demo`, what `scripts/run.sh main` runs): its code path on tiny synthetic data."""
from __future__ import annotations

import json

import pytest

from equiconvert import cli
from equiconvert.cli import main
from equiconvert.recipes.demo import CPU_DEFAULTS, SUMMARY_FILE, format_summary

TINY = ["--dataset", "synthetic", "--widths", "4,8,16", "--batch-size", "16", "--physical-batch-size", "16",
        "--device", "cpu", "--no-progress"]


def run_demo_json(capsys, *argv: str) -> dict:
    assert main(["demo", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_demo_trains_and_reports(tmp_path, capsys):
    out = tmp_path / "demo"
    (out).mkdir()
    (out / "log.jsonl").write_text('{"step": 99, "eval": {"accuracy": 1.0}}\n')  # a previous run's log is replaced
    summary = run_demo_json(capsys, *TINY, "--steps", "3", "--out", str(out))

    assert 0.0 <= summary["test_accuracy"] <= 1.0
    assert summary["test_examples"] == 128 and summary["train_examples"] == 512
    assert 0 < summary["epsilon"] <= summary["target_epsilon"] == CPU_DEFAULTS.epsilon
    assert summary["delta"] == CPU_DEFAULTS.delta and summary["accountant"] == "rdp"
    assert summary["params_before"] > 0 and summary["params_after"] > 0
    assert summary["max_equivariance_error"] < 1e-4
    assert summary["equivariance_input_size"] == 32
    assert summary["steps"] == summary["requested_steps"] == 3 and summary["stopped_reason"] is None
    assert summary["wall_time_s"] > 0 and 0 < summary["train_time_s"] <= summary["wall_time_s"]
    assert summary["device"] == "cpu" and summary["threads"] >= 1
    assert summary["settings"]["widths"] == [4, 8, 16] and summary["settings"]["lr"] == CPU_DEFAULTS.lr
    assert json.loads((out / SUMMARY_FILE).read_text()) == summary
    result = json.loads((out / "result.json").read_text())  # run_training's own record of the same run
    assert result["test_accuracy"] == summary["test_accuracy"] and result["evals"] == []
    assert result["init_gain"] == summary["settings"]["init_gain"] == CPU_DEFAULTS.init_gain == 2 ** -0.5

    text = format_summary(summary)
    for needle in ("parameters", "max error", "epsilon", "delta", "test accuracy", "wall time", "DP-SGD: 3 steps"):
        assert needle in text, needle
    assert "STOPPED EARLY" not in text


def test_demo_time_limit_says_where_it_stopped(tmp_path, capsys):
    summary = run_demo_json(capsys, *TINY, "--steps", "5", "--time-limit", "1e-9", "--out", str(tmp_path))
    assert summary["stopped_reason"] == "time_limit" and summary["steps"] == 1 and summary["requested_steps"] == 5
    assert 0 < summary["epsilon"] < summary["target_epsilon"]
    assert "STOPPED EARLY at step 1 of 5" in format_summary(summary)


def test_demo_readable_output(tmp_path, capsys):
    assert main(["demo", *TINY, "--steps", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("equiconvert demo: equiconvert:resnet9 (widths 4,8,16) -> D4")
    assert "test accuracy:" in out and "privacy: epsilon" in out and "max error" in out


def test_demo_defaults_live_in_one_place():
    parse = cli._parser().parse_args
    assert cli.demo_settings(parse(["demo"])) == CPU_DEFAULTS
    big = cli.demo_settings(parse(["demo", "--device", "cuda", "--steps", "1000", "--batch-size", "2048",
                                   "--widths", "16,32,64", "--aug-mult", "4", "--time-limit", "0"]))
    assert (big.device, big.steps, big.batch_size, big.widths, big.aug_mult) == ("cuda", 1000, 2048, (16, 32, 64), 4)
    assert big.time_limit_s is None and big.epsilon == CPU_DEFAULTS.epsilon
    assert cli.demo_settings(parse(["demo", "--init-gain", "1.4142"])).init_gain == 1.4142


def test_missing_fashion_mnist_says_where_to_put_it(tmp_path, capsys):
    missing = tmp_path / "no-such-dir"
    assert main(["demo", "--data-dir", str(missing), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    for needle in (str(missing), "train-images-idx3-ubyte.gz", "dataset-fashion-mnist", "--data-dir",
                   "/usr/share/datasets/fashion-mnist"):
        assert needle in lines[0], needle


def test_bad_widths_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--widths", "8,x"])
    assert exc.value.code == 2 and "--widths" in capsys.readouterr().err
