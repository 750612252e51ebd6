"""`import equiconvert` and `equiconvert --help` load neither torchvision, timm nor escnn (each costs seconds), and
each subcommand's `--help` loads neither torch nor opacus."""

from __future__ import annotations

import json

import pytest

from equiconvert.cli import SUBCOMMANDS
from tests.support.paths import run_python

# one interpreter (importing torch is most of the cost): which heavy packages are loaded after each stage
PROBE = """
import contextlib, io, json, sys
def loaded():
    return sorted({m.split('.')[0] for m in sys.modules} & {'torchvision', 'timm', 'escnn'})
stages = {}
import equiconvert, equiconvert.models
stages['import equiconvert'] = loaded()
from equiconvert.cli import main
for argv in (['--help'], ['convert', '--help'], ['train', '--help'], ['demo', '--help']):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
    stages[' '.join(argv)] = loaded()
equiconvert.create_model('torchvision:resnet18')
stages['create_model torchvision:resnet18'] = loaded()
print(json.dumps(stages))
"""


@pytest.fixture(scope="module")
def stages() -> dict[str, list[str]]:
    done = run_python("-c", PROBE, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_import_and_help_load_no_heavy_package(stages):
    assert {stage: heavy for stage, heavy in stages.items() if not stage.startswith("create_model")} == {
        "import equiconvert": [],
        "--help": [],
        "convert --help": [],
        "train --help": [],
        "demo --help": [],
    }


# `python -m equiconvert SUB --help` in a fresh interpreter (after importing the modules named after SUB): the heavy
# packages loaded once the help is printed
HELP_PROBE = """
import contextlib, importlib, io, json, runpy, sys
for module in sys.argv[2:]:
    importlib.import_module(module)
sys.argv = ['equiconvert', sys.argv[1], '--help']
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    runpy.run_module('equiconvert', run_name='__main__')
heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'opacus', 'escnn', 'torchvision', 'timm'})
print(json.dumps({'help': out.getvalue(), 'heavy': heavy}))
"""


def _help_probe(argv: list[str]) -> dict:
    done = run_python("-c", HELP_PROBE, *argv, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_subcommand_help_loads_neither_torch_nor_opacus(command):
    """Every `--help` stays fast: the parsers take their choices and defaults from torch-free modules."""
    probe = _help_probe([command])
    assert probe["help"].startswith(f"usage: equiconvert {command}")
    assert probe["heavy"] == []


def test_the_help_probe_sees_a_heavy_import():
    probe = _help_probe(["recipes", "torch"])
    assert probe["help"].startswith("usage: equiconvert recipes") and probe["heavy"] == ["torch"]


def test_the_probe_sees_a_heavy_import(stages):
    assert stages["create_model torchvision:resnet18"] == ["torchvision"]


def test_rules_for_optional_packages_apply_once_those_are_imported():
    """Stochastic depth (torchvision) and DropPath (timm) are registered by name, so that rules import neither."""
    from timm.layers import DropPath
    from torchvision.ops import StochasticDepth

    from equiconvert.convert.registry import module_rule
    from equiconvert.convert.rules.structural import convert_pass_through

    assert module_rule(StochasticDepth) is convert_pass_through
    assert module_rule(DropPath) is convert_pass_through
    assert module_rule(type("StochasticDepth", (StochasticDepth,), {})) is None  # exact types only, as for all rules


def test_the_training_and_privacy_front_ends_are_top_level_names():
    """DPTrainer and DPConfig (equiconvert.training) and make_private (equiconvert.privacy) load on first use."""
    import equiconvert
    from equiconvert.privacy.engine import make_private
    from equiconvert.training.dp_config import DPConfig
    from equiconvert.training.trainer import DPTrainer

    assert (equiconvert.DPTrainer, equiconvert.DPConfig, equiconvert.make_private) == (
        DPTrainer,
        DPConfig,
        make_private,
    )
    assert {"DPTrainer", "DPConfig", "make_private"} <= set(equiconvert.__all__)
