"""Where equiconvert keeps what it computes once: kernel bases, decoded data sets, escnn's own cache."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$EQUICONVERT_CACHE_DIR, else $XDG_CACHE_HOME/equiconvert, else ~/.cache/equiconvert."""
    explicit = os.environ.get("EQUICONVERT_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "equiconvert"
