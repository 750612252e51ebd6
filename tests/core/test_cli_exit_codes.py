"""The command line's exit statuses: one per error category (equiconvert.cli.common.EXIT_CODES), a traceback and 1
for anything else (a bug), --version, and a --help that imports no torch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys

import pytest

from equiconvert import errors
from equiconvert.cli import main
from equiconvert.cli.common import EXIT_CODES, flag_message
from equiconvert.errors import ConversionError, DataError, EquiconvertError, ParameterError, PrivacyError, UsageError
from tests.support.paths import REPO_ROOT, repo_env
from tests.support.train_args import tiny_train_args

CATEGORIES = (UsageError, DataError, PrivacyError, ConversionError, errors.RunError)


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_each_category_has_its_own_exit_status():
    assert set(EXIT_CODES) == set(CATEGORIES)
    assert EXIT_CODES[UsageError] == 2 and EXIT_CODES[DataError] == 3 and EXIT_CODES[PrivacyError] == 4
    assert len(set(EXIT_CODES.values())) == len(EXIT_CODES) and not {0, 1, 130} & set(EXIT_CODES.values())


def test_a_usage_error_exits_2(capsys):
    assert main(["train", "--recipe", "no-such-recipe"]) == 2
    assert "--recipe no-such-recipe" in _error_line(capsys)


def test_a_missing_data_set_exits_3(tmp_path, capsys):
    args = tiny_train_args(tmp_path / "run", dataset="fashion-mnist", data_dir=str(tmp_path / "no-data-here"))
    assert main(args) == 3
    assert "fashion" in _error_line(capsys).lower()


def test_a_privacy_budget_that_cannot_hold_exits_4(tmp_path, capsys):
    assert main(tiny_train_args(tmp_path / "run", delta=0.01)) == 4  # synthetic: N = 512, delta >= 1/N
    assert _error_line(capsys).startswith("error: --delta 0.01 >= 1/N = 1/512")


def test_a_library_bug_is_not_caught_its_traceback_shows(monkeypatch):
    """A plain ValueError from inside the library is a bug: main lets it through (Python prints the traceback and
    exits 1), it is not reported as a user error."""
    from equiconvert.recipes import recipe

    def broken() -> dict[str, str]:
        raise ValueError("a bug inside the library")

    monkeypatch.setattr(recipe, "shipped_recipes", broken)
    with pytest.raises(ValueError, match="a bug inside the library"):
        main(["recipes"])


def test_version_prints_the_package_version(capsys):
    from equiconvert._version import __version__

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out == f"equiconvert {__version__}\n"


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_no_torch(flag):
    """`python -m equiconvert --help` (and --version) loads neither torch nor any subcommand module."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "equiconvert", flag],
        capture_output=True,
        text=True,
        env=repo_env(),
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")}
    assert "equiconvert.cli" in imported and "equiconvert" in imported  # the probe sees the package's imports
    assert not {name for name in imported if name.split(".")[0] in {"torch", "escnn", "opacus", "numpy", "tqdm"}}
    assert not {name for name in imported if name.startswith("equiconvert.cli.") and name not in _LIGHT_CLI}


_LIGHT_CLI = {"equiconvert.cli.commands", "equiconvert.cli.common"}


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--recipe", "no-such-recipe"], "error: --recipe no-such-recipe: neither a file nor a shipped recipe"),
        (["--recipe", "cpu_main_job", "--logger", "tensorbord"], "error: --logger: unknown logger 'tensorbord'"),
    ],
)
def test_a_mistyped_recipe_or_logger_is_refused_in_one_line_before_torch_loads(argv, error):
    """The names are checked before the heavy imports: the refusal costs no torch, data or model start-up."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "equiconvert", "train", *argv, "--out", "unused"],
        capture_output=True,
        text=True,
        env=repo_env(),
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time")]
    assert len(lines) == 1 and lines[0].startswith(error), done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")}
    assert "equiconvert.recipes.recipe" in imported  # the probe sees the train command's imports
    assert not {name for name in imported if name.split(".")[0] in {"torch", "opacus", "numpy"}}


def test_the_cli_names_library_parameters_by_their_flags():
    error = ParameterError("out=/x is not empty: give resume=True to continue it, or another out=")
    assert flag_message(error) == "--out /x is not empty: give --resume to continue it, or another --out"
    assert flag_message(ParameterError("model.out=2 and layout=3 stay")) == "model.out=2 and layout=3 stay"


def test_library_errors_name_parameters_not_flags(tmp_path):
    from equiconvert.training.devices import resolve_device
    from equiconvert.training.run_folder import OutputFolderError, prepare_out

    with pytest.raises(OutputFolderError) as caught:
        prepare_out(tmp_path, resume=True, overwrite=False)
    assert str(caught.value).startswith("resume=True: there is no checkpoint") and "--" not in str(caught.value)
    with pytest.raises(ValueError) as caught:
        resolve_device("tpu")
    assert str(caught.value).startswith("device=tpu: not a device name") and isinstance(caught.value, UsageError)


def _project_error_classes() -> list[type]:
    """Every exception class defined in the package (read with ast, then imported)."""
    found = []
    for path in sorted((REPO_ROOT / "equiconvert").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                parts = path.relative_to(REPO_ROOT).with_suffix("").parts
                module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found.append(getattr(importlib.import_module(module), node.name))
    return found


def test_every_project_error_is_in_the_tree_under_one_category():
    classes = _project_error_classes()
    assert {"RecipeError", "TableError", "CLIError", "ConfigError", "BookkeepingUnsupportedError"} <= {
        cls.__name__ for cls in classes
    }
    for cls in classes:
        if cls is EquiconvertError or cls in CATEGORIES:
            continue
        assert issubclass(cls, EquiconvertError), cls
        assert sum(issubclass(cls, category) for category in CATEGORIES) == 1, cls
