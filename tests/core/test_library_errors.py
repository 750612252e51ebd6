"""Library code raises the project's errors (equiconvert.errors) naming Python parameters, never CLI flags; the
checks read the source with ast."""

from __future__ import annotations

import argparse
import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from equiconvert.cli.common import flag_message
from equiconvert.recipes.recipe import Recipe, RecipeError, apply_overrides, load_recipe, parse_kwargs
from tests.support.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "equiconvert"
# builtins a library error would otherwise be raised as; each project error keeps one as a second base
BUILTIN_ERRORS = {
    "ArithmeticError",
    "AttributeError",
    "Exception",
    "FileNotFoundError",
    "IndexError",
    "KeyError",
    "LookupError",
    "NotImplementedError",
    "OSError",
    "RuntimeError",
    "TypeError",
    "ValueError",
}
# (file name, enclosing function, builtin): raises whose builtin type is the protocol itself
ALLOWED = {
    # a module __getattr__ must raise AttributeError: getattr(), hasattr() and `from ... import` rely on it
    ("__init__.py", "__getattr__", "AttributeError"),  # equiconvert/__init__.py caches what it loads
    ("_lazy.py", "__getattr__", "AttributeError"),  # the module __getattr__ lazy_exports builds for subpackages
    ("dp_config.py", "__getattr__", "AttributeError"),  # FIELD_LIMITS/PER_SAMPLE_METHODS, read from the registries
    # a failed OS call raises OSError with its errno, as the os module's functions do
    ("worker_lifetime.py", "die_with_parent", "OSError"),
    # the abstract method of a base class a user subclasses
    ("loggers.py", "log_record", "NotImplementedError"),
}


def _builtin_raises(path: Path) -> Iterator[tuple[str, str, int]]:
    """(enclosing function, builtin name, line) of each `raise Builtin(...)` or `raise Builtin` in `path`."""

    def visit(node: ast.AST, function: str) -> Iterator[tuple[str, str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Raise) and child.exc is not None:
                target = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(target, ast.Name) and target.id in BUILTIN_ERRORS:
                    yield function, target.id, child.lineno
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            yield from visit(child, inner)

    yield from visit(ast.parse(path.read_text()), "<module>")


def test_library_code_raises_no_plain_builtin_errors():
    found = [
        f"{path.relative_to(REPO_ROOT)}:{line} raise {name} in {function}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for function, name, line in _builtin_raises(path)
        if (path.name, function, name) not in ALLOWED
    ]
    assert not found, "raise an equiconvert.errors class (it keeps the builtin as a base) instead:\n" + "\n".join(found)


def test_the_allow_list_names_raises_that_exist():
    present = {
        (path.name, function, name) for path in PACKAGE.rglob("*.py") for function, name, _ in _builtin_raises(path)
    }
    assert ALLOWED <= present, ALLOWED - present


def _cli_flags() -> set[str]:
    """Every option string of the command line and of each of its subcommands."""
    from equiconvert.cli import _parser

    parsers, flags = [_parser()], set()
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return flags


def _library_modules() -> list[Path]:
    """The package less the command line: cli/ and __main__.py (`python -m equiconvert` runs the command line)."""
    cli = {PACKAGE / "__main__.py"}
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p not in cli and p.relative_to(PACKAGE).parts[0] != "cli"]


def _imports_cli(tree: ast.AST, path: Path) -> bool:
    package = ".".join(path.relative_to(REPO_ROOT).parent.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(alias.name.startswith("equiconvert.cli") for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names = [f"{module}.{alias.name}" for alias in node.names]
            if any(name == "equiconvert.cli" or name.startswith("equiconvert.cli.") for name in [module, *names]):
                return True
    return False


def _raise_strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, text) of each string constant, f-string parts included, inside a raise statement."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for inner in ast.walk(node.exc):
                if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                    yield node.lineno, inner.value


def test_the_flag_scan_sees_the_command_lines_flags():
    assert {"--out", "--recipe", "--set", "--group", "--model-kwargs", "--device"} <= _cli_flags()


def test_library_modules_neither_import_the_cli_nor_name_its_flags_in_errors():
    flags = _cli_flags()
    found = []
    for path in _library_modules():
        tree = ast.parse(path.read_text())
        where = path.relative_to(REPO_ROOT)
        if _imports_cli(tree, path):
            found.append(f"{where}: imports equiconvert.cli")
        for line, text in _raise_strings(tree):
            named = sorted(set(re.findall(r"--[a-z][a-z0-9-]*", text)) & flags)
            if named:
                found.append(f"{where}:{line}: an error names the flag(s) {named}")
    assert not found, "library errors name parameters (cli/common.py PARAMETER_FLAGS maps them):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "call, parameter, flag",
    [
        (lambda: load_recipe("no-such-recipe"), "name_or_path=no-such-recipe", "--recipe no-such-recipe"),
        (lambda: apply_overrides(Recipe(), ["dp.epsilon"]), "assignments='dp.epsilon'", "--set 'dp.epsilon'"),
        (lambda: parse_kwargs("widths"), "model_kwargs='widths'", "--model-kwargs 'widths'"),
    ],
)
def test_recipe_errors_name_the_parameter_and_the_cli_prints_its_flag(call, parameter, flag):
    with pytest.raises(RecipeError) as caught:
        call()
    assert str(caught.value).startswith(parameter) and "--" not in str(caught.value)
    assert flag_message(caught.value).startswith(flag)


def test_a_name_mismatch_reads_as_its_message_though_it_is_a_key_error():
    from equiconvert.data import load_dataset
    from equiconvert.errors import NameMismatchError, UsageError

    with pytest.raises(NameMismatchError) as caught:
        load_dataset("nope", None)
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, UsageError)
    assert str(caught.value).startswith("dataset=nope: unknown data set")  # KeyError's str() would quote it
