"""Where the repository is, and the environment a subprocess needs to import its equiconvert."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_env() -> dict[str, str]:
    """os.environ with the repository first on PYTHONPATH (a fresh interpreter imports this checkout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_python(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """This interpreter run on `args` in a fresh process that imports this checkout, its output captured as text."""
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=repo_env(), cwd=REPO_ROOT, timeout=timeout
    )
