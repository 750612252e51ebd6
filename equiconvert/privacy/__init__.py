"""Differentially private training of converted models.

`DPTrainer`/`DPConfig` load on first use, so importing a submodule (e.g. opacus_interop)
does not pull in the trainer and its dependencies.
"""
from typing import Any

__all__ = ["DPConfig", "DPTrainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
