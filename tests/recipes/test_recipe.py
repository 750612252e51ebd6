"""Typed recipes: the shipped TOML files, dotted --set overrides, and their refusals."""

from __future__ import annotations

import pytest

from equiconvert.training.dp_config import DPConfig
from equiconvert.recipes.recipe import (
    Recipe,
    RecipeError,
    apply_overrides,
    load_recipe,
    parse_kwargs,
    parse_value,
    shipped_recipes,
)
from equiconvert.recipes.run_spec import spec_of, trainer_options


def test_the_paper_cell_recipe_holds_the_papers_settings():
    r = load_recipe("cifar10_paper_d4_eps8")
    assert (r.model.name, r.conversion.group, r.data.dataset) == ("equiconvert:equivariant_resnet9", "D4", "cifar10")
    t = r.trainer
    assert (
        t.target_epsilon,
        t.delta,
        t.batch_size,
        t.aug_mult,
        t.lr,
        t.max_grad_norm,
        t.steps,
        t.ema_decay,
        t.eval_every,
        t.checkpoint_every,
    ) == (8.0, 1e-5, 8192, 4, 2.0, 2.0, 2200, 0.999, 200, 100)
    assert load_recipe("cifar10_paper_baseline_eps8").conversion.group == "none"


def test_fashion_mnist_recipe_and_every_shipped_one_loads():
    f = load_recipe("fashion_mnist_d1_eps3").trainer
    assert (
        f.max_grad_norm,
        f.lr,
        f.lr_schedule,
        f.ema_decay,
        f.steps,
        f.batch_size,
        f.aug_mult,
        f.accountant,
        f.augment_padding,
        f.test_shifts,
    ) == (0.1, 40.0, "cosine", 0.995, 4000, 2048, 2, "prv", 1, "cross1")
    assert set(shipped_recipes()) >= {
        "cifar10_paper_d4_eps8",
        "cifar10_paper_baseline_eps8",
        "fashion_mnist_d1_eps3",
        "cpu_main_job",
    }
    for name in shipped_recipes():
        spec_of(load_recipe(name))  # dataset and out set in every shipped recipe


def test_set_overrides_dotted_keys_with_toml_values():
    r = apply_overrides(
        load_recipe("cifar10_paper_d4_eps8"),
        [
            "dp.epsilon=2",
            "model.kwargs.norm_groups=4",
            "schedule.lr_schedule=cosine",
            "run.out=somewhere",
            "model.kwargs.widths=[4, 8, 16]",
            "schedule.ema_decay=0",
        ],
    )
    assert r.trainer.target_epsilon == 2.0 and r.model.kwargs == {"norm_groups": 4, "widths": (4, 8, 16)}
    assert r.trainer.lr_schedule == "cosine" and r.run.out == "somewhere"
    assert trainer_options(r)["ema_decay"] is None  # 0: no EMA
    assert load_recipe("cifar10_paper_d4_eps8").trainer.target_epsilon == 8.0  # the shipped one unchanged
    assert parse_value("1e-5") == 1e-5 and parse_value("true") is True and parse_value("resnet9") == "resnet9"


def test_unknown_keys_are_refused_by_name(tmp_path):
    with pytest.raises(RecipeError, match="'dp.epsilonn'"):
        apply_overrides(Recipe(), ["dp.epsilonn=3"])
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        apply_overrides(Recipe(), ["dp.epsilon"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[schedule]\nstep = 3\n")
    with pytest.raises(RecipeError, match=r"bad\.toml: unknown recipe key 'schedule.step'"):
        load_recipe(str(bad))
    with pytest.raises(RecipeError, match="neither a file nor a shipped recipe"):
        load_recipe("no_such_recipe")


def test_defaults_come_from_dpconfig():
    assert Recipe().trainer == DPConfig()


def test_model_kwargs_parse_lists_and_scalars():
    assert parse_kwargs("widths=8,16,32,norm_groups=4,activation=relu,res2=false") == {
        "widths": (8, 16, 32),
        "norm_groups": 4,
        "activation": "relu",
        "res2": False,
    }
    with pytest.raises(RecipeError, match="key=value"):
        parse_kwargs("widths")


def _train_options():
    import argparse

    from equiconvert import cli

    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices["train"]._actions if a.option_strings and a.dest != "help"]


def test_train_has_at_most_26_flags_each_with_help_and_its_default():
    options = _train_options()
    assert len(options) <= 26, [a.option_strings for a in options]
    for action in options:
        assert action.help and "default" in action.help, action.option_strings


def test_flags_override_the_recipe_and_set_comes_last():
    from equiconvert import cli
    from equiconvert.cli.train import train_recipe

    parse = cli._parser().parse_args
    r = train_recipe(
        parse(
            [
                "train",
                "--recipe",
                "cifar10_paper_d4_eps8",
                "--epsilon",
                "2",
                "--steps",
                "10",
                "--model-kwargs",
                "norm_groups=4",
                "--set",
                "schedule.steps=20",
            ]
        )
    )
    assert (r.trainer.target_epsilon, r.trainer.steps, r.trainer.batch_size) == (2.0, 20, 8192)
    assert r.model.kwargs == {"norm_groups": 4} and r.conversion.group == "D4"
    assert train_recipe(parse(["train"])) == Recipe()  # no flag given: the dataclasses' defaults


def test_recipes_command_lists_and_prints(capsys):
    from equiconvert.cli import main

    assert main(["recipes"]) == 0
    listing = capsys.readouterr().out
    assert "cifar10_paper_d4_eps8:" in listing and "cpu_main_job:" in listing
    assert main(["recipes", "fashion_mnist_d1_eps3"]) == 0
    assert 'lr_schedule = "cosine"' in capsys.readouterr().out
