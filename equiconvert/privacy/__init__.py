"""Differentially private training of converted models.

The public names load on first use, so importing a submodule (e.g. opacus_interop)
does not pull in the trainer and its dependencies. `check_dp_safe(model, example_input)`
refuses models that DP-SGD cannot train privately (by layer names and by behaviour).
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "DPConfig": "dp_config",
    "DPTrainer": "trainer",
    "check_dp_safe": "dp_safety",
    "make_private": "engine",
    "PrivacyEngine": "engine",
    "BatchMemoryManager": "dp_loader",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
