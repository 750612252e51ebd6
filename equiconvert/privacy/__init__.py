"""Differentially private training of converted models.

`DPTrainer`/`DPConfig` load on first use, so importing a submodule (e.g. opacus_interop)
does not pull in the trainer and its dependencies. `check_dp_safe(model, example_input)`
refuses models that DP-SGD cannot train privately (by layer names and by behaviour).
"""
from typing import Any

__all__ = ["DPConfig", "DPTrainer", "check_dp_safe"]
_HOMES = {"DPConfig": "trainer", "DPTrainer": "trainer", "check_dp_safe": "dp_safety"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
