"""Where the repository is, and the environment a subprocess needs to import its equiconvert."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_env() -> dict[str, str]:
    """os.environ with the repository first on PYTHONPATH (a fresh interpreter imports this checkout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env
