"""DPConfig's one table of limits: check_config, the command line's recipe checks and the registries all use it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch import nn

from equiconvert.cli import _parser
from equiconvert.cli.common import CLIError
from equiconvert.cli.recipe_flags import check_recipe
from equiconvert.privacy.accounting import ACCOUNTANT_FACTORIES, ACCOUNTANTS, make_accountant
from equiconvert.training.dp_config import (
    FIELD_LIMITS,
    OFF_OPTIONS,
    OPTIMIZERS,
    ConfigError,
    DPConfig,
    check_config,
)
from equiconvert.training.ema import ExponentialMovingAverage
from equiconvert.training.trainer import DPTrainer
from equiconvert.recipes.recipe import Recipe, set_key
from equiconvert.recipes.run_spec import trainer_options
from tests.support.cli_errors import run_error

FIELDS = {f.name: f for f in dataclasses.fields(DPConfig)}


def test_every_limit_is_a_field_and_every_default_passes():
    assert set(FIELD_LIMITS) <= set(FIELDS)
    assert all("None" in str(FIELDS[name].type) for name in OFF_OPTIONS)  # off is None
    check_config(DPConfig())
    for name, (valid, _) in FIELD_LIMITS.items():
        default = getattr(DPConfig(), name)
        assert default is None or valid(default), name


@pytest.mark.parametrize(
    ("options", "field", "message"),
    [
        ({"accountant": "gdp"}, "accountant", "accountant must be one of ('rdp', 'prv'), got 'gdp'"),
        ({"optimizer": "adam"}, "optimizer", "optimizer must be one of ('sgd', 'nadam', 'custom'), got 'adam'"),
        ({"ema_decay": -0.5}, "ema_decay", "ema_decay must be in (0, 1), got -0.5 (None: no EMA)"),
        ({"ema_decay": 1.0}, "ema_decay", "ema_decay must be in (0, 1), got 1.0"),
        (
            {"checkpoint_every": -1},
            "checkpoint_every",
            "checkpoint_every must be an integer >= 1, got -1 (None: no periodic",
        ),
        ({"momentum": 1.0}, "momentum", "momentum must be in [0, 1), got 1.0"),
        ({"batch_size": None}, "batch_size", "batch_size must be an integer >= 1, got None"),
        ({"lr": True}, "lr", "lr must be a finite number > 0, got True"),
        ({"lr": float("inf")}, "lr", "lr must be a finite number > 0, got inf"),
        ({"max_grad_norm": float("inf")}, "max_grad_norm", "max_grad_norm must be a finite number > 0, got inf"),
        ({"noise_multiplier": float("inf")}, "noise_multiplier", "noise_multiplier must be a finite number > 0"),
        ({"batch_size": float("inf")}, "batch_size", "batch_size must be an integer >= 1, got inf"),
        # sampled and accounted as 2 but divided by 2.5
        ({"batch_size": 2.5}, "batch_size", "batch_size must be an integer >= 1, got 2.5"),
        ({"physical_batch_size": 8.0}, "physical_batch_size", "physical_batch_size must be an integer >= 1, got 8.0"),
        ({"steps": 10.5}, "steps", "steps must be an integer >= 0, got 10.5"),
        ({"steps": -1, "noise_multiplier": 1.0}, "steps", "steps must be an integer >= 0, got -1"),
        ({"steps": 0}, "steps", "steps must be >= 1 for the noise to be calibrated"),
    ],
)
def test_check_config_names_the_field_its_rule_and_the_value(options, field, message):
    with pytest.raises(ConfigError) as caught:
        check_config(DPConfig(**options))
    assert caught.value.field == field and str(caught.value).startswith(message)


def test_zero_steps_train_with_a_given_noise_multiplier():
    check_config(DPConfig(steps=0, target_epsilon=None, noise_multiplier=1.0))


def test_an_unknown_accountant_is_refused_when_the_trainer_is_built():
    with pytest.raises(ConfigError, match="accountant must be one of"):
        DPTrainer(nn.Linear(2, 2), accountant="gdp", progress=False)


def test_an_unknown_accountant_is_refused_by_the_command_line_before_any_data(tmp_path, capsys):
    missing = str(tmp_path / "no-data-here")
    out = tmp_path / "o"
    args = ("train", "--dataset", "cifar10", "--data-dir", missing, "--out", str(out))
    error = run_error(capsys, *args, "--set", "dp.accountant=gdp")
    assert error == "error: --accountant gdp: must be one of ('rdp', 'prv')"  # the key's flag
    assert not out.exists()


def test_the_accountant_registry_is_the_one_list():
    assert ACCOUNTANTS == tuple(ACCOUNTANT_FACTORIES) == ("rdp", "prv")
    assert DPConfig().accountant in ACCOUNTANTS
    for name in ACCOUNTANTS:
        assert make_accountant(name).mechanism() == name
    with pytest.raises(ValueError, match=r"unknown accountant 'moments'; choose one of \('rdp', 'prv'\)"):
        make_accountant("moments")
    train = _parser()._subparsers._group_actions[0].choices["train"]
    (flag,) = [a for a in train._actions if "--accountant" in a.option_strings]
    assert tuple(flag.choices) == ACCOUNTANTS


@pytest.mark.parametrize(("name", "kind"), [("sgd", torch.optim.SGD), ("nadam", torch.optim.NAdam)])
def test_the_trainer_builds_its_optimizer_from_the_registry(name, kind):
    assert set(OPTIMIZERS) == {"sgd", "nadam"}
    trainer = DPTrainer(nn.Linear(2, 2), optimizer=name, lr=0.25, momentum=0.5, progress=False)
    assert type(trainer.optimizer) is kind and trainer.optimizer.defaults["lr"] == 0.25
    if name == "sgd":
        assert trainer.optimizer.defaults["momentum"] == 0.5


def test_a_recipe_turns_an_option_off_by_zero(tmp_path):
    recipe = Recipe()
    set_key(recipe, "data.dataset", "synthetic")
    set_key(recipe, "run.out", str(tmp_path))
    for name in OFF_OPTIONS:
        set_key(recipe, f"schedule.{name}", 0)
    config = DPConfig(**trainer_options(recipe))
    assert {name: getattr(config, name) for name in OFF_OPTIONS} == dict.fromkeys(OFF_OPTIONS)
    check_recipe(recipe)  # 0 is off in a recipe, not out of range
    check_config(config)


def test_zero_is_off_in_the_api_too_and_a_checkpoint_that_stored_zero_resumes():
    from equiconvert.training.trainer_checkpoint import resume_identity

    config = DPConfig(ema_decay=0, eval_every=0, checkpoint_every=0)
    assert (config.ema_decay, config.eval_every, config.checkpoint_every) == (None, None, None)
    check_config(config)
    stored = {**dataclasses.asdict(DPConfig()), "checkpoint_every": 0, "eval_every": 0}
    assert resume_identity(stored) == resume_identity(
        dataclasses.asdict(DPConfig(checkpoint_every=None, eval_every=None))
    )
    assert resume_identity({**stored, "lr": 3.0}) != resume_identity(dataclasses.asdict(DPConfig()))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("schedule.ema_decay", 1.5, "--set schedule.ema_decay=1.5: must be in (0, 1) (0: no EMA)"),
        (
            "schedule.checkpoint_every",
            -1,
            "--set schedule.checkpoint_every=-1: must be an integer >= 1 (0: no periodic",
        ),
        ("schedule.momentum", 1, "--set schedule.momentum=1: must be in [0, 1)"),
        ("dp.target_epsilon", -1.0, "--epsilon -1: must be a finite number > 0"),
        ("schedule.lr", float("inf"), "--lr inf: must be a finite number > 0"),
        ("schedule.optimizer", "adam", "--set schedule.optimizer=adam: must be one of ('sgd', 'nadam', 'custom')"),
        ("run.threads", 0, "--threads 0: give at least 1 CPU thread"),
    ],
)
def test_recipe_checks_name_the_flag_or_key_and_the_rule(key, value, message):
    recipe = Recipe()
    set_key(recipe, key, value)
    with pytest.raises(CLIError) as caught:
        check_recipe(recipe)
    assert str(caught.value).startswith(message)


def test_the_ema_and_the_trainer_take_their_defaults_from_dpconfig():
    assert ExponentialMovingAverage(nn.Linear(2, 2)).decay == DPConfig().ema_decay
    assert inspect.signature(DPTrainer).parameters["lr_schedule"].default == DPConfig().lr_schedule


def test_a_trainer_with_a_fractional_expected_batch_size_is_refused_before_any_data():
    """batch_size=2.5 used to sample at rate 2/N, account with 2 and divide the noisy sum by 2.5."""
    with pytest.raises(ConfigError, match=r"batch_size must be an integer >= 1, got 2\.5"):
        DPTrainer(nn.Linear(2, 2), batch_size=2.5, progress=False)
