"""Check a recipe value against the type of the field it sets, so that a misspelt value is an error, not a string.

TOML and --set read `no`, `"3"` or `2.5` as they are written; a bool field given the string "no" would otherwise
count as true (seeded, non-private noise switched on by `--set dp.insecure_seeded_noise=no`). Every value is
checked here against its dataclass field's annotation before it is set.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any

_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string (in quotes in TOML)"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def describe(hint: Any) -> str:
    """What a field of this type takes, in words."""
    if _is_union(hint):
        return " or ".join(describe(arg) for arg in typing.get_args(hint) if arg is not type(None))
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        element = typing.get_args(hint)[0]
        return f"a list of {_PLURALS.get(element, describe(element))}"
    if origin is dict or hint is dict:
        return "a table"
    return _NAMES.get(hint, str(hint))


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def matches(value: Any, hint: Any) -> tuple[bool, Any]:
    """(whether value fits the type hint, the value as the field keeps it: an int for a float field becomes a
    float, a list for a tuple field a tuple)."""
    if hint is Any:
        return True, value
    if _is_union(hint):
        for arg in typing.get_args(hint):
            ok, converted = matches(value, arg)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return False, value
        element = typing.get_args(hint)[0]
        converted = [matches(item, element) for item in value]
        return all(ok for ok, _ in converted), tuple(item for _, item in converted)
    if origin is dict or hint is dict:
        return isinstance(value, dict), value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and not (isinstance(value, float) and math.isnan(value)), float(value) if number else value
    if hint is str:
        return isinstance(value, str), value
    return True, value  # a type this checker does not model is left to the field's own validation
