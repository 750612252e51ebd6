"""The main job (`equiconvert demo`, what `scripts/run.sh main` runs): its code path on tiny synthetic data."""

from __future__ import annotations

import json

from equiconvert import cli
from equiconvert.cli import main
from equiconvert.cli.demo import demo_settings
from equiconvert.recipes import recipe_checks
from equiconvert.recipes.demo import MAIN_JOB_RECIPE, SUMMARY_FILE, format_summary

TINY = [
    "--set",
    "data.dataset=synthetic",
    "--set",
    "model.kwargs.widths=[4, 8, 16]",
    "--set",
    "dp.batch_size=16",
    "--set",
    "dp.physical_batch_size=16",
    "--device",
    "cpu",
    "--set",
    "run.progress=false",
]
T = MAIN_JOB_RECIPE.trainer


def run_demo_json(capsys, *argv: str) -> dict:
    assert main(["demo", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_demo_trains_and_reports(tmp_path, capsys):
    out = tmp_path / "demo"
    (out).mkdir()
    (out / "log.jsonl").write_text('{"step": 99, "eval": {"accuracy": 1.0}}\n')  # a previous run's log is replaced
    summary = run_demo_json(capsys, *TINY, "--set", "schedule.steps=3", "--out", str(out))

    assert 0.0 <= summary["test_accuracy"] <= 1.0
    assert summary["test_examples"] == 128 and summary["train_examples"] == 512
    assert 0 < summary["epsilon"] <= summary["target_epsilon"] == T.target_epsilon == 3.0
    assert summary["delta"] == T.delta and summary["accountant"] == "rdp"
    assert summary["params_before"] > 0 and summary["params_after"] > 0
    assert summary["max_equivariance_error"] < 1e-4
    assert summary["equivariance_input_size"] == 32
    assert summary["steps"] == summary["requested_steps"] == 3 and summary["stopped_reason"] is None
    assert summary["wall_time_s"] > 0 and 0 < summary["train_time_s"] <= summary["wall_time_s"]
    assert summary["device"] == "cpu" and summary["threads"] >= 1
    assert summary["settings"]["widths"] == [4, 8, 16] and summary["settings"]["lr"] == T.lr
    assert json.loads((out / SUMMARY_FILE).read_text()) == summary
    result = json.loads((out / "result.json").read_text())  # run_training's own record of the same run
    assert result["test_accuracy"] == summary["test_accuracy"] and result["evals"] == []
    assert result["init_gain"] == summary["settings"]["init_gain"] == MAIN_JOB_RECIPE.conversion.init_gain == 2**-0.5
    probe = summary["step_probe"]  # 3 steps fit the 600 s budget: none dropped
    assert probe["planned_steps"] == probe["requested_steps"] == 3 and probe["seconds_per_step"] > 0

    text = format_summary(summary)
    for needle in ("parameters", "max error", "epsilon", "delta", "test accuracy", "wall time", "DP-SGD: 3 steps"):
        assert needle in text, needle
    assert "STOPPED EARLY" not in text


def test_demo_time_limit_says_where_it_stopped(tmp_path, capsys):
    summary = run_demo_json(
        capsys,
        *TINY,
        "--set",
        "schedule.steps=5",
        "--set",
        "run.plan_steps=false",
        "--time-limit",
        "1e-9",
        "--out",
        str(tmp_path),
    )
    assert summary["stopped_reason"] == "time_limit" and summary["steps"] == 1 and summary["requested_steps"] == 5
    assert 0 < summary["epsilon"] < summary["target_epsilon"]
    assert "STOPPED EARLY at step 1 of 5" in format_summary(summary)


def test_demo_readable_output(tmp_path, capsys, monkeypatch):
    checks = []
    checked = recipe_checks.check_recipe
    monkeypatch.setattr(recipe_checks, "check_recipe", lambda recipe: checks.append(recipe) or checked(recipe))
    assert main(["demo", *TINY, "--set", "schedule.steps=1", "--out", str(tmp_path)]) == 0
    assert len(checks) == 1 and checks[0].run.overwrite  # the recipe is checked once, as it runs
    out = capsys.readouterr().out
    assert out.startswith("equiconvert demo: equiconvert:resnet9 (widths 4,8,16) -> D4")
    assert "test accuracy:" in out and "privacy: epsilon" in out and "max error" in out


def test_the_probe_fits_the_steps_to_a_tiny_budget_and_spends_the_whole_epsilon(tmp_path, capsys, monkeypatch):
    from equiconvert.recipes import step_plan

    # the probe's timing is fixed here (a real one varies with the machine's load): 10 s a step plans
    # int(0.8 * 100 / 10) = 8 steps, which the tiny model runs well inside the 100 s limit even on a loaded machine
    # (with the DP-safety probe of each new batch shape, which the first steps of a Poisson run mostly are)
    monkeypatch.setattr(step_plan, "probe_seconds_per_step", lambda *args, **kwargs: 10.0)
    budget = 100.0
    summary = run_demo_json(
        capsys, *TINY, "--set", "schedule.steps=100000", "--time-limit", str(budget), "--out", str(tmp_path)
    )
    probe = summary["step_probe"]
    assert probe["requested_steps"] == 100000 and probe["time_budget_s"] == budget
    assert probe["seconds_per_step"] == 10.0 and probe["planned_steps"] == int(probe["plan_share"] * budget / 10.0) == 8
    assert summary["steps"] == probe["planned_steps"] and summary["stopped_reason"] is None
    assert summary["target_epsilon"] * 0.99 <= summary["epsilon"] <= summary["target_epsilon"]


def test_demo_defaults_live_in_one_place():
    parse = cli._parser().parse_args
    assert demo_settings(parse(["demo"])) == MAIN_JOB_RECIPE
    big = demo_settings(
        parse(
            [
                "demo",
                "--device",
                "cuda",
                "--set",
                "schedule.steps=1000",
                "--set",
                "dp.batch_size=2048",
                "--set",
                "model.kwargs.widths=[16, 32, 64]",
                "--set",
                "dp.aug_mult=4",
                "--time-limit",
                "0",
            ]
        )
    )
    t = big.trainer
    assert (big.run.device, t.steps, t.batch_size, big.model.kwargs["widths"], t.aug_mult) == (
        "cuda",
        1000,
        2048,
        (16, 32, 64),
        4,
    )
    assert big.run.time_limit_s is None and t.target_epsilon == T.target_epsilon
    assert demo_settings(parse(["demo", "--set", "conversion.init_gain=1.4142"])).conversion.init_gain == 1.4142
    assert MAIN_JOB_RECIPE.run.time_limit_s == 600 and MAIN_JOB_RECIPE.run.plan_steps


def test_missing_fashion_mnist_says_where_to_put_it(tmp_path, capsys):
    missing = tmp_path / "no-such-dir"
    assert (
        main(["demo", "--data-dir", str(missing), "--out", str(tmp_path / "out"), "--set", "run.progress=false"])
        == 3  # a data error
    )
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    for needle in (
        str(missing),
        "train-images-idx3-ubyte.gz",
        "dataset-fashion-mnist",
        "--data-dir",
        "/usr/share/datasets/fashion-mnist",
    ):
        assert needle in lines[0], needle


def test_unknown_recipe_key_is_one_error_line(capsys):
    assert main(["demo", "--set", "model.widths=8,16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set model.widths=8,16: unknown recipe key 'model.widths'")
