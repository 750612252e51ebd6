"""Session set-up shared by every test: a seeded RNG and caches of this session's own.

Each session starts from an empty equiconvert cache (bases, decoded data sets, escnn's
tables) in a fresh temporary folder, so a warm cache on the machine can hide no
cold-start defect; the folder is removed at the end. The variables are set here, at
import, before any test module imports equiconvert (cache.cache_root reads them per call).
"""

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

assert "equiconvert" not in sys.modules, "equiconvert was imported before tests/conftest.py set its cache folder"

pytest_plugins = ["tests.support.tiers"]  # the markers slow, zoo, benchmarks, escnn, distributed

SESSION_CACHE = tempfile.mkdtemp(prefix="equiconvert-test-cache-")
os.environ["EQUICONVERT_CACHE_DIR"] = os.path.join(SESSION_CACHE, "equiconvert")
os.environ["XDG_CACHE_HOME"] = os.path.join(SESSION_CACHE, "xdg")  # where the default would lie without the above
os.environ.pop("EQUICONVERT_NO_CACHE", None)  # the disk cache is on unless a test turns it off


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def cold_cache(tmp_path, monkeypatch) -> Iterator[Path]:
    """An empty disk cache (tmp_path, switched on) and no basis in memory: what a fresh install sees."""
    from equiconvert import basis
    from equiconvert.cache import NO_CACHE_VARIABLE

    monkeypatch.setenv("EQUICONVERT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(NO_CACHE_VARIABLE, raising=False)
    basis.clear_memory_cache()
    yield tmp_path
    basis.clear_memory_cache()
