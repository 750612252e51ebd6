"""Package metadata: one source for the version, the license, the type marker, and lint-clean sources."""

from __future__ import annotations

import re
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

import equiconvert
from tests.support.paths import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_version_has_one_source():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "equiconvert._version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+|rc\d+)?", equiconvert.__version__)
    # the version setuptools reads statically is the one the package reports
    text = (REPO_ROOT / "equiconvert" / "_version.py").read_text()
    assert re.findall(r'^__version__ = "([^"]+)"$', text, flags=re.MULTILINE) == [equiconvert.__version__]


def test_license_and_type_marker_ship():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert "Apache License" in (REPO_ROOT / "LICENSE").read_text()[:200]
    assert (REPO_ROOT / "equiconvert" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["equiconvert"]
    for key in ("description", "readme", "keywords", "classifiers", "urls", "requires-python"):
        assert project.get(key), key


def test_ruff_check_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_check_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
