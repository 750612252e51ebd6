"""Public names of a package that load their submodule on first use (PEP 562's module __getattr__)."""

from importlib import import_module
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """The module __getattr__ of `package`: exports maps each public name to the submodule defining it."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(import_module(f".{exports[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
