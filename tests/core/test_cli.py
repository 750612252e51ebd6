"""The `equiconvert` command line: convert, demo, and its one-line errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from equiconvert.cli import SUBCOMMANDS, _parser, main
from equiconvert.cli.convert import JSON_VALID_SIZES, measurement_size
from equiconvert.cli.demo import _print_demo
from tests.support.paths import REPO_ROOT, repo_env
from tests.support.train_args import tiny_train_args

RESNET18_PARAMS_10_CLASSES = 11_181_642


def run_json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    out = capsys.readouterr().out
    return json.loads(out)


def tiny_train_result(tmp_path, *extra: str, **overrides: str | float | None) -> dict:
    """The result.json of tiny_train_args(tmp_path / "run", *extra, **overrides)."""
    out = tmp_path / "run"
    assert main(tiny_train_args(out, *extra, **overrides)) == 0
    return json.loads((out / "result.json").read_text())


def run_error(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


def test_every_registered_subcommand_has_a_handler_in_the_listed_order():
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == ["convert", "demo", "train", "recipes", "audit"]
    assert len(SUBCOMMANDS) == 5  # one module each; `train` and `recipes` have their own
    for name, parser in sub.choices.items():
        assert callable(parser.get_default("func")), name


def test_module_entry_point_resnet18_json():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "equiconvert",
            "convert",
            "torchvision:resnet18",
            "--group",
            "D4",
            "--input-size",
            "225",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=repo_env(),
        cwd=REPO_ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["model"] == "torchvision:resnet18"
    assert data["group"] == "D4"
    assert data["params_before"] == RESNET18_PARAMS_10_CLASSES
    assert data["params_after"] > 0
    assert 225 in data["valid_input_sizes"]
    assert data["input_size"] == 225 and data["input_size_valid"] is True
    assert data["max_equivariance_error"] <= 1e-5
    assert data["equivariance"]["input_size"] == 225
    assert data["layers"]
    assert data["conversion_time_s"] >= 0


def test_convert_resnet9_json_keys_and_check(capsys):
    data = run_json(
        capsys, "convert", "equiconvert:resnet9", "--group", "D4", "--input-size", "8", "--head", "invariant", "--json"
    )
    for key in (
        "params_before",
        "params_after",
        "valid_input_sizes",
        "valid_input_rule",
        "layers",
        "warnings",
        "max_equivariance_error",
        "group",
        "model",
        "conversion_time_s",
        "equivariance",
        "width",
        "input_size",
        "input_size_valid",
        "invariant_output",
        "num_valid_input_sizes",
    ):
        assert key in data, key
    assert data["params_before"] == 2_448_714  # resnet9, 10 classes, ScaleNorm
    assert data["input_size"] == 8 and data["input_size_valid"] is True
    assert data["invariant_output"] is True
    assert data["valid_input_sizes"][:4] == [8, 16, 24, 32]
    assert len(data["valid_input_sizes"]) == JSON_VALID_SIZES < data["num_valid_input_sizes"]
    assert data["valid_input_rule"].startswith("H = W")
    layer = data["layers"][0]
    assert set(layer) == {"node", "module_path", "before", "after"}
    assert "Conv2d" in layer["before"] and "SteerableConv2d" in layer["after"]
    eq = data["equivariance"]
    assert eq["input_size"] == 8
    assert len(eq["errors"]) == 8 and {"rot90", "rot0+flip"} <= set(eq["errors"])  # D4 acts exactly on the grid
    assert data["max_equivariance_error"] == max(eq["errors"].values()) <= 1e-5


def test_convert_refuses_an_invalid_size_and_names_the_nearest_valid_ones(capsys):
    assert main(["convert", "torchvision:resnet18", "--group", "D4", "--input-size", "224", "--no-check"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "error: input size 224 does not keep exact equivariance" in captured.err
    assert "H = W = 1 mod 32, from 33 on; nearest: 193, 225" in captured.err
    assert "--pad-to-valid" in captured.err and "--crop-to-valid" in captured.err


@pytest.mark.parametrize("flag, target", [("--pad-to-valid", 225), ("--crop-to-valid", 193)])
def test_convert_fits_an_invalid_size_with_pad_or_crop(capsys, flag, target):
    data = run_json(
        capsys, "convert", "torchvision:resnet18", "--group", "D4", "--input-size", "224", flag, "--no-check", "--json"
    )
    assert data["input_size"] == 224 and data["input_size_valid"] is True
    assert data["valid_input_sizes"] == [224]
    assert data["input_fit"].startswith(f"input 224 -> {target}: ")
    assert data["layers"][0]["node"] == "input_fit" and data["layers"][0]["before"] == "(inserted)"
    text_exit = main(["convert", "torchvision:resnet18", "--group", "D4", "--input-size", "224", flag, "--no-check"])
    assert text_exit == 0 and f"input fit: input 224 -> {target}" in capsys.readouterr().out


def test_measurement_size_falls_back_to_default_size():
    def fake(valid: bool, default):
        def default_input_size():
            if default is None:
                raise ValueError("no valid size")
            return default

        return SimpleNamespace(report=SimpleNamespace(input_size_valid=valid), default_input_size=default_input_size)

    assert measurement_size(fake(True, 33), 225) == 225
    assert measurement_size(fake(False, 33), 224) == 33
    assert measurement_size(fake(None, 32), None) == 32
    assert measurement_size(fake(False, None), 30) == 30  # nothing valid: measure the requested size
    assert measurement_size(fake(None, None), None) is None


def test_width_params_matches_parameter_count(capsys):
    data = run_json(
        capsys, "convert", "equiconvert:resnet9", "--group", "D4", "--width", "params", "--no-check", "--json"
    )
    assert data["width"].startswith("params")
    assert abs(data["params_after"] - data["params_before"]) <= 0.02 * data["params_before"]


def test_width_float_kappa_and_model_options(capsys):
    data = run_json(
        capsys,
        "convert",
        "equiconvert:resnet9",
        "--group",
        "C4",
        "--width",
        "1.5",
        "--num-classes",
        "7",
        "--in-channels",
        "1",
        "--no-check",
        "--json",
    )
    assert data["width"] == "kappa=1.5"
    assert data["group"] == "C4"
    assert data["layers"][0]["before"].startswith("Conv2d(1, 64")
    assert data["layers"][-1]["before"].startswith("Linear(") and "out_features=7" in data["layers"][-1]["before"]


def test_unknown_model_prefix(capsys):
    line = run_error(capsys, "convert", "keras:resnet18", "--group", "D4")
    assert "keras:resnet18" in line
    for prefix in ("torchvision:", "timm:", "equiconvert:"):
        assert prefix in line
    bare = run_error(capsys, "convert", "resnet99", "--group", "D4")  # bare names: equiconvert, torchvision, timm
    assert "resnet99" in bare and "torchvision" in bare and "timm" in bare


def test_unknown_model_names(capsys):
    assert "resnet9" in run_error(capsys, "convert", "equiconvert:resnet10", "--group", "D4")
    assert "not_a_model" in run_error(capsys, "convert", "torchvision:not_a_model", "--group", "D4")


def test_missing_timm_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # makes `import timm` raise ImportError
    line = run_error(capsys, "convert", "timm:resnet18", "--group", "D4")
    assert "timm is not installed" in line


def test_unknown_group(capsys):
    line = run_error(capsys, "convert", "equiconvert:resnet9", "--group", "Q4")
    assert "'Q4'" in line and "D1" in line


def test_torchvision_rejects_other_channel_counts(capsys):
    assert "3 input channels" in run_error(
        capsys, "convert", "torchvision:resnet18", "--group", "D4", "--in-channels", "1"
    )


def test_bad_width_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["convert", "equiconvert:resnet9", "--group", "D4", "--width", "wide"])
    assert exc.value.code == 2
    assert "--width" in capsys.readouterr().err


def test_a_width_that_is_not_positive_is_refused_before_building_the_model(capsys, monkeypatch):
    import equiconvert.models

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the width was checked")

    monkeypatch.setattr(equiconvert.models, "create_model", never)
    assert main(["convert", "equiconvert:resnet9", "--group", "D4", "--width", "-1", "--no-check"]) == 2
    assert "width kappa must be a finite number > 0, got -1.0" in capsys.readouterr().err


def test_demo_conversion_only_json_lists_both_models(capsys):
    summary = run_json(capsys, "demo", "--conversion-only", "--json")
    assert summary["group"] == "D4"
    models = {m["model"]: m for m in summary["models"]}
    assert set(models) == {"torchvision:resnet18", "equiconvert:resnet9"}
    assert models["torchvision:resnet18"]["params_before"] == RESNET18_PARAMS_10_CLASSES
    for m in models.values():
        assert m["params_after"] > 0
        assert m["layers_swapped"] > 0
        assert m["valid_input_rule"]
        assert m["check_input_size"] in m["valid_input_sizes"]
        assert m["max_equivariance_error"] <= 1e-5
        assert m["invariant_output"] is True
    assert summary["total_time_s"] > 0

    _print_demo(summary)  # the readable form of the same summary
    out = capsys.readouterr().out
    assert "== torchvision:resnet18 -> D4" in out and "== equiconvert:resnet9 -> D4" in out
    assert "max equivariance error at" in out and "total wall time" in out


def test_train_on_synthetic_data_writes_result(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        tiny_train_args(
            out,
            model="equiconvert:resnet9",
            model_kwargs="widths=8,16,32",
            group="C4",
            steps=2,
            batch_size=16,
            aug_mult=2,
            epsilon=8,
            physical_batch_size=16,
        )
    )
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    for key in (
        "test_accuracy",
        "epsilon",
        "delta",
        "noise_multiplier",
        "steps",
        "batch_size",
        "aug_mult",
        "params",
        "wall_time_s",
        "group",
        "model",
    ):
        assert key in result, key
    assert result["steps"] == 2 and 0 < result["epsilon"] <= 8 and result["group"] == "C4"
    assert result["per_sample_method"] == "bookkeeping"  # what the default "auto" chose for this model
    assert result["max_equivariance_error"] <= 1e-5
    assert (out / "log.jsonl").exists()
    assert json.loads(capsys.readouterr().out)["test_accuracy"] == result["test_accuracy"]


def test_train_threads_sets_the_processes_cpu_threads(tmp_path, capsys):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        code = main(
            tiny_train_args(
                tmp_path / "run",
                model="equiconvert:resnet9",
                model_kwargs="widths=8,16,32",
                group="none",
                epsilon=8,
                threads=1,
            )
        )
        assert code == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()
    assert "--threads 0: give at least 1" in run_error(capsys, *tiny_train_args(tmp_path / "bad", threads=0))


def test_train_init_gain_reaches_the_model_and_the_result(tmp_path, capsys):
    result = tiny_train_result(
        tmp_path,
        "--set",
        "conversion.init_gain=0.5",
        model="equiconvert:resnet9",
        model_kwargs="widths=8,16,32",
        group="C4",
        epsilon=8,
    )
    assert result["init_gain"] == 0.5
    capsys.readouterr()
    error = run_error(capsys, *tiny_train_args(tmp_path / "bad", "--set", "conversion.init_gain=1", group="none"))
    assert "conversion.init_gain" in error and "--group none" in error


def test_train_seed_fixes_the_initial_weights_too(tmp_path, capsys):
    """Same --seed, same run (initial weights; sampling and noise in the reproducible, not private, mode); another
    seed, another run."""
    import torch

    def final_loss(seed: str, name: str) -> float:
        torch.manual_seed(int(name[-1]) + 100)  # whatever the global RNG held before must not matter
        out = tmp_path / name
        args = tiny_train_args(
            out,
            "--set",
            "schedule.checkpoint_every=0",
            "--insecure-seeded-noise",
            model="equiconvert:resnet9",
            model_kwargs="widths=4,8,8",
            group="C4",
            epsilon=8,
            seed=seed,
        )
        assert main(args) == 0
        return json.loads((out / "result.json").read_text())["test_loss"]

    first, again, other = final_loss("3", "a1"), final_loss("3", "a2"), final_loss("4", "b3")
    capsys.readouterr()
    assert first == again and first != other


def test_train_baseline_replaces_batch_norm_and_widths_only_for_resnet9(tmp_path, capsys):
    code = main(tiny_train_args(tmp_path, model="torchvision:resnet18", model_kwargs="widths=8,16,32", group="none"))
    error = capsys.readouterr().err
    assert code == 2 and "cannot build torchvision:resnet18" in error and "keyword argument 'widths'" in error


@pytest.mark.parametrize("group, params", [("D4", 255_675), ("none", 155_434)])
def test_train_paper_model_preset_and_its_unconverted_network(tmp_path, group, params):
    out = tmp_path / group
    code = main(
        tiny_train_args(
            out, "--set", "schedule.eval_every=1", model="equiconvert:equivariant_resnet9", group=group, steps=2
        )
    )
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    assert result["params"] == params and result["params_before"] == 155_434
    assert [e["step"] for e in result["evals"]] == [1, 2]
    if group == "D4":  # the paper's head pools a 2x2 grid: equivariant up to the head, not invariant
        assert result["invariant_head"] is False


def test_train_head_and_normalize_reach_the_model_the_trainer_and_the_result(tmp_path, capsys):
    """--head invariant makes the paper preset's logits flip-invariant (its own head is not); --normalize is used."""
    result = tiny_train_result(
        tmp_path,
        "--set",
        "conversion.head=invariant",
        "--set",
        "data.normalize_mean=0.25",
        "--set",
        "data.normalize_std=0.4",
        model="equiconvert:equivariant_resnet9",
        group="D1",
    )
    assert result["invariant_head"] is True and result["max_equivariance_error"] < 1e-4
    assert (result["normalize_mean"], result["normalize_std"]) == (0.25, 0.4)
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert "conversion.head" in run_error(
        capsys, *tiny_train_args(bad, "--set", "conversion.head=invariant", group="none")
    )
    error = run_error(capsys, *tiny_train_args(bad, "--set", "data.normalize_std=0"))
    assert "--set data.normalize_std=0: must be > 0" in error


def test_train_width_rescales_the_paper_preset_and_is_refused_for_its_baseline(tmp_path, capsys):
    result = tiny_train_result(
        tmp_path, "--set", "conversion.width=1.0", model="equiconvert:equivariant_resnet9", group="D4"
    )
    # kappa 1 instead of the preset's 1.5: fewer fields per layer, so fewer than Table 1's 255,675 parameters
    assert result["width"] == 1.0 and 0 < result["params"] < 255_675
    capsys.readouterr()
    for model in ("equiconvert:equivariant_resnet9", "equiconvert:resnet9"):  # never silently ignored
        args = tiny_train_args(tmp_path / "bad", "--set", "conversion.width=1.0", model=model, group="none")
        error = run_error(capsys, *args)
        assert "conversion.width" in error and "--group none" in error


def test_train_filter_gradients_fastest_records_each_layers_kernel(tmp_path, capsys, monkeypatch):
    from equiconvert.privacy import filter_gradients

    monkeypatch.setattr(filter_gradients, "_fastest", {})
    result = tiny_train_result(
        tmp_path,
        "--set",
        "dp.per_sample_method=bookkeeping",
        "--set",
        "dp.filter_gradients=fastest",
        model="equiconvert:resnet9",
        model_kwargs="widths=4,8,8",
        group="C4",
        aug_mult=2,
    )
    kernels = result["filter_gradient_kernels"]
    assert (
        result["filter_gradients"] == "fastest"
        and kernels
        and set(kernels.values()) <= {"products", "grouped", "unfolded"}
    )
    assert any("float32" in layer for layer in kernels)  # the training's layers, not only the float64 probe's


def test_train_activation_builds_the_paper_preset_and_its_baseline_with_it(tmp_path, capsys):
    converted = tiny_train_result(
        tmp_path / "d1",
        "--set",
        "conversion.head=invariant",
        model="equiconvert:equivariant_resnet9",
        group="D1",
        model_kwargs="activation=tanh",
    )
    # float32 check: tanh networks round to ~1e-4 (exactness in float64: tests/models/test_equivariant_resnet9.py); a
    # broken symmetry shows as ~0.3
    assert converted["activation"] == "tanh" and converted["max_equivariance_error"] < 1e-3
    plain = tiny_train_result(
        tmp_path / "none", model="equiconvert:equivariant_resnet9", group="none", model_kwargs="activation=tanh"
    )
    assert plain["activation"] == "tanh" and plain["params"] == 155_434  # an activation has no parameters
    assert (
        tiny_train_result(tmp_path / "default", model="equiconvert:equivariant_resnet9", group="none")["activation"]
        == "mish"
    )
    capsys.readouterr()
    error = run_error(
        capsys,
        *tiny_train_args(tmp_path / "bad", model="equiconvert:resnet9", group="D4", model_kwargs="activation=tanh"),
    )  # never silently ignored
    assert "model keyword activation applies to equiconvert:equivariant_resnet9 only" in error


def test_resuming_into_another_activation_is_refused(tmp_path, capsys):
    """Activations have no parameters: the checkpoint would load into the other network without complaint."""
    first = tiny_train_result(
        tmp_path,
        "--set",
        "schedule.checkpoint_every=1",
        model="equiconvert:equivariant_resnet9",
        group="none",
        model_kwargs="activation=tanh",
    )
    assert first["activation"] == "tanh" and "Tanh()" in (tmp_path / "run" / "model.txt").read_text()
    capsys.readouterr()
    error = run_error(
        capsys,
        *tiny_train_args(tmp_path / "run", "--resume", model="equiconvert:equivariant_resnet9", group="none", steps=2),
    )
    assert "another network" in error and "Tanh()" in error and "Mish()" in error
    resumed = tiny_train_result(
        tmp_path,
        "--set",
        "schedule.checkpoint_every=1",
        "--resume",
        model="equiconvert:equivariant_resnet9",
        group="none",
        model_kwargs="activation=tanh",
    )
    assert resumed["steps"] == 1


def test_train_norm_groups_and_crop_padding_reach_the_model_and_the_augmentation(tmp_path, capsys):
    converted = tiny_train_result(
        tmp_path / "d1",
        "--set",
        "data.augment_padding=2",
        model="equiconvert:equivariant_resnet9",
        group="D1",
        model_kwargs="norm_groups=2",
        aug_mult=2,
    )
    assert converted["norm_groups"] == 2 and converted["augment_padding"] == 2
    assert converted["ema_final_decay"] == pytest.approx(0.1)  # one step: the warm-up's (1 + 0) / (10 + 0)
    assert "num_groups=2," in (tmp_path / "d1" / "run" / "model.txt").read_text()
    assert "num_groups=8," not in (tmp_path / "d1" / "run" / "model.txt").read_text()
    plain = tiny_train_result(
        tmp_path / "none", model="equiconvert:equivariant_resnet9", group="none", model_kwargs="norm_groups=16"
    )
    assert plain["norm_groups"] == 16 and "GroupNorm(16, 16" in (tmp_path / "none" / "run" / "model.txt").read_text()
    capsys.readouterr()
    args = tiny_train_args(
        tmp_path / "bad", model="equiconvert:equivariant_resnet9", group="none", model_kwargs="norm_groups=3"
    )
    error = run_error(capsys, *args)
    assert "norm_groups 3" in error and "must divide every width" in error
    error = run_error(
        capsys,
        *tiny_train_args(tmp_path / "bad", model="equiconvert:resnet9", group="D4", model_kwargs="norm_groups=4"),
    )  # never silently ignored
    assert "model keyword norm_groups applies to equiconvert:equivariant_resnet9 only" in error
    error = run_error(capsys, *tiny_train_args(tmp_path / "bad", "--set", "data.augment_padding=-1"))
    assert "--set data.augment_padding=-1: must be an integer >= 0" in error


def test_train_no_res2_reaches_the_preset_and_its_baseline_and_is_recorded(tmp_path, capsys):
    converted = tiny_train_result(
        tmp_path / "d1",
        "--set",
        "conversion.head=invariant",
        model="equiconvert:equivariant_resnet9",
        group="D1",
        model_kwargs="res2=false",
    )  # the paper's 2x2 grid head is not invariant
    full = tiny_train_result(
        tmp_path / "full", "--set", "conversion.head=invariant", model="equiconvert:equivariant_resnet9", group="D1"
    )
    assert converted["res2"] is False and full["res2"] is True and converted["params"] < full["params"] * 0.6
    assert converted["max_equivariance_error"] < 1e-4
    plain = tiny_train_result(
        tmp_path / "none", model="equiconvert:equivariant_resnet9", group="none", model_kwargs="res2=false"
    )
    assert plain["res2"] is False and "(res2): Identity()" in (tmp_path / "none" / "run" / "model.txt").read_text()
    assert converted["pool_after_res2"] is False
    late = tiny_train_result(
        tmp_path / "late",
        "--set",
        "conversion.head=invariant",
        model="equiconvert:equivariant_resnet9",
        group="D1",
        model_kwargs="pool_after_res2=true",
    )
    assert late["pool_after_res2"] is True and late["res2"] is True and late["params"] == full["params"]
    assert late["max_equivariance_error"] < 1e-4
    capsys.readouterr()
    error = run_error(
        capsys, *tiny_train_args(tmp_path / "bad", model="equiconvert:resnet9", group="D4", model_kwargs="res2=false")
    )  # never silently ignored
    assert "model keyword res2 applies to equiconvert:equivariant_resnet9 only" in error
    error = run_error(
        capsys,
        *tiny_train_args(
            tmp_path / "bad", model="equiconvert:resnet9", group="D4", model_kwargs="pool_after_res2=true"
        ),
    )
    assert "model keyword pool_after_res2 applies to equiconvert:equivariant_resnet9 only" in error


def test_train_test_shifts_adds_shift_averaged_metrics_beside_the_plain_ones(tmp_path, capsys):
    plain = tiny_train_result(tmp_path / "plain", "--insecure-seeded-noise", group="none", seed=3)
    averaged = tiny_train_result(
        tmp_path / "averaged", "--insecure-seeded-noise", "--set", "data.test_shifts=cross1", group="none", seed=3
    )
    assert plain["test_shifts"] is None and "test_accuracy_shift_averaged" not in plain
    assert averaged["test_shifts"] == "cross1"
    assert averaged["test_accuracy"] == plain["test_accuracy"] and averaged["brier"] == plain["brier"]
    bounds = {"test_accuracy": 1, "brier": 2, "ece": 1, "test_loss": float("inf")}
    assert all(0 <= averaged[f"{key}_shift_averaged"] <= bound for key, bound in bounds.items())
    assert averaged["test_loss_shift_averaged"] != averaged["test_loss"]
    assert main(tiny_train_args(tmp_path / "bad", "--set", "data.test_shifts=cross9")) == 2
    assert "unknown test-time shift set 'cross9'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # refused before the run folder is made
