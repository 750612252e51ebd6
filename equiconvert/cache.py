"""Where equiconvert keeps what it computes once: kernel bases, decoded data sets, escnn's own cache."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ParameterError

NO_CACHE_VARIABLE = "EQUICONVERT_NO_CACHE"
_SWITCH = {"": False, "0": False, "false": False, "no": False, "1": True, "true": True, "yes": True}


def cache_root() -> Path:
    """$EQUICONVERT_CACHE_DIR, else $XDG_CACHE_HOME/equiconvert, else ~/.cache/equiconvert."""
    explicit = os.environ.get("EQUICONVERT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "equiconvert"


def disk_cache_enabled() -> bool:
    """False when $EQUICONVERT_NO_CACHE is 1/true/yes: kernel bases, escnn's tables and decoded data sets are then
    built in memory, never read from or written to cache_root() (read-only or shared machines, cold-start checks)."""
    value = os.environ.get(NO_CACHE_VARIABLE, "").strip().lower()
    if value not in _SWITCH:
        raise ParameterError(
            f"${NO_CACHE_VARIABLE} must be 1/true/yes (no disk cache) or 0/false/no/empty, got {value!r}"
        )
    return not _SWITCH[value]
