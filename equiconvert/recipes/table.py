"""Recipe tables: the cells of a results table (recipe, --set overrides, seeds, the paper's number), from TOML.

A table file lists the runs behind one published table, so one command (benchmarks/accuracy.py table NAME) can
train all of them and render the table beside the paper's numbers. Every cell is checked when the file is
loaded (its recipe exists, its overrides name known keys), so a typo fails before any GPU time is spent.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .recipe import RecipeError, apply_overrides, load_recipe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TABLE_DIR = "tables"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class TableError(UsageError, ValueError):
    """A table file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Cell:
    """One row of the table: a recipe with overrides, trained once per seed."""

    name: str  # the runs' folder prefix: OUT/<name>_seed<seed>
    model: str  # the row's label, e.g. "D4 Equivariant-ResNet9"
    recipe: str  # a shipped recipe's name, or a TOML file's absolute path
    overrides: tuple[str, ...]  # KEY=VALUE, passed as `train --set KEY=VALUE`
    seeds: tuple[int, ...]
    paper: float | None  # the paper's accuracy (percent) for this cell, None where it has none
    epsilon: float | None  # the target epsilon the recipe and overrides give

    def train_args(self) -> list[str]:
        """The `equiconvert train` arguments that define the cell (seed, output and devices excluded)."""
        args = ["--recipe", self.recipe]
        for override in self.overrides:
            args += ["--set", override]
        return args


@dataclass(frozen=True)
class Table:
    """A results table: what the rendered summary says about it, and its cells in row order."""

    name: str
    title: str
    description: str
    cells: tuple[Cell, ...]
    source: str  # where it was loaded from, for messages
    order: int | None = None  # the section's place on the results page
    figure: str | None = None  # the plot's path relative to the results page, e.g. img/NAME.png
    figure_title: str = ""
    notes: tuple[str, ...] = ()

    def select(self, names: list[str]) -> tuple[Cell, ...]:
        """The cells named, in table order; an unknown name is refused with the known ones."""
        known = [c.name for c in self.cells]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise TableError(f"cells: {', '.join(unknown)} not in {self.source} (its cells: {', '.join(known)})")
        return tuple(c for c in self.cells if c.name in names)


_TABLE_KEYS = {"title", "description", "order", "figure", "figure_title", "notes", "cells"}
_CELL_KEYS = {"name", "model", "recipe", "set", "seeds", "paper"}


def shipped_tables() -> dict[str, str]:
    """The tables that ship with equiconvert: name -> first comment line."""
    found = {}
    for entry in sorted(resources.files(__package__).joinpath(TABLE_DIR).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            lines = entry.read_text().splitlines()
            found[entry.name.removesuffix(".toml")] = lines[0].lstrip("# ").strip() if lines else ""
    return found


def _table_text(name_or_path: str) -> tuple[str, str, Path | None]:
    """The TOML text, where it is (for messages) and its folder (for relative recipe paths; None if shipped)."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise TableError(f"table {name_or_path}: no such file (shipped tables: {', '.join(shipped_tables())})")
        return path.read_text(), str(path), path.resolve().parent
    shipped = resources.files(__package__).joinpath(TABLE_DIR, f"{name_or_path}.toml")
    if not shipped.is_file():
        raise TableError(
            f"table {name_or_path}: neither a file nor a shipped table (shipped: {', '.join(shipped_tables())})"
        )
    return shipped.read_text(), f"equiconvert/recipes/{TABLE_DIR}/{name_or_path}.toml", None


def _typed(where: str, key: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):  # no key takes a boolean (Python counts it an int)
        raise TableError(f"{where}: {key} must be {what}, got {value!r}")
    return value


def _recipe_ref(where: str, recipe: str, folder: Path | None) -> str:
    """A recipe file named relative to the table file becomes an absolute path; a shipped name stays a name."""
    if recipe.endswith(".toml") and folder is not None and not Path(recipe).is_absolute():
        return str(folder / recipe)
    if recipe.endswith(".toml") and folder is None:
        raise TableError(f"{where}: recipe {recipe!r}: a shipped table names shipped recipes, not files")
    return recipe


def _cell(where: str, index: int, body: Any, folder: Path | None) -> Cell:
    at = f"{where}: cells[{index}]"
    if not isinstance(body, dict):
        raise TableError(f"{at} must be a table ([[cells]]), got {body!r}")
    unknown = sorted(set(body) - _CELL_KEYS)
    if unknown:
        raise TableError(f"{at}: unknown key {unknown[0]!r}; a cell takes {', '.join(sorted(_CELL_KEYS))}")
    for key in ("name", "model", "recipe", "seeds"):
        if key not in body:
            raise TableError(f"{at}: {key} is missing")
    name = _typed(at, "name", body["name"], str, "a string")
    if not NAME_PATTERN.fullmatch(name):
        raise TableError(f"{at}: name {name!r} must be letters, digits, '.', '_' and '-' (it names folders)")
    at = f"{where}: cells[{index}] ({name})"
    overrides = _typed(at, "set", body.get("set", []), list, 'a list of "KEY=VALUE" strings')
    for item in overrides:
        _typed(at, "set", item, str, 'a list of "KEY=VALUE" strings')
    seeds = _typed(at, "seeds", body["seeds"], list, "a list of integers")
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        raise TableError(f"{at}: seeds must be a non-empty list of integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise TableError(f"{at}: seeds {seeds!r} repeats a seed")
    paper = body.get("paper")
    if paper is not None:
        paper = float(_typed(at, "paper", paper, (int, float), "a number (percent) or left out"))
    recipe = _recipe_ref(at, _typed(at, "recipe", body["recipe"], str, "a string"), folder)
    try:
        loaded = apply_overrides(load_recipe(recipe), list(overrides))
    except RecipeError as exc:
        raise TableError(f"{at}: {exc}") from None
    return Cell(
        name=name,
        model=_typed(at, "model", body["model"], str, "a string"),
        recipe=recipe,
        overrides=tuple(overrides),
        seeds=tuple(seeds),
        paper=paper,
        epsilon=None if loaded.trainer.target_epsilon is None else float(loaded.trainer.target_epsilon),
    )


def load_table(name_or_path: str) -> Table:
    """The table in a TOML file (a path, or a shipped table's name), every cell checked."""
    text, where, folder = _table_text(name_or_path)
    try:
        body = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TableError(f"{where}: not valid TOML ({exc})") from None
    unknown = sorted(set(body) - _TABLE_KEYS)
    if unknown:
        raise TableError(f"{where}: unknown key {unknown[0]!r}; a table takes {', '.join(sorted(_TABLE_KEYS))}")
    for key in ("title", "description", "cells"):
        if key not in body:
            raise TableError(f"{where}: {key} is missing")
    cells_body = _typed(where, "cells", body["cells"], list, "a list of [[cells]] tables")
    if not cells_body:
        raise TableError(f"{where}: cells is empty")
    cells = tuple(_cell(where, i, c, folder) for i, c in enumerate(cells_body))
    names = [c.name for c in cells]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise TableError(f"{where}: cells: the name {repeated[0]!r} is used twice")
    notes = _typed(where, "notes", body.get("notes", []), list, "a list of strings")
    order = body.get("order")
    return Table(
        name=Path(where).stem,
        title=_typed(where, "title", body["title"], str, "a string"),
        description=_typed(where, "description", body["description"], str, "a string"),
        cells=cells,
        source=where,
        order=None if order is None else _typed(where, "order", order, int, "an integer"),
        figure=_typed(where, "figure", body.get("figure"), (str, type(None)), "a path like img/NAME.png"),
        figure_title=_typed(where, "figure_title", body.get("figure_title", body["title"]), str, "a string"),
        notes=tuple(_typed(where, "notes", n, str, "a list of strings") for n in notes),
    )
