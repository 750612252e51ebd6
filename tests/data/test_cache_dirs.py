"""One cache root for everything equiconvert caches; bases and data sets in their own folders of it."""

from __future__ import annotations

from pathlib import Path

from equiconvert.basis import basis_dir
from equiconvert.cache import cache_root
from equiconvert.data import cache_dir


def test_explicit_cache_dir_wins_and_splits_bases_from_datasets(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("EQUICONVERT_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    assert cache_dir() == tmp_path / "mine" / "datasets"
    assert basis_dir().parent == tmp_path / "mine" / "bases"


def test_xdg_then_home_default(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("EQUICONVERT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "equiconvert" / "datasets"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "equiconvert"
    assert basis_dir().parent == Path(tmp_path / "home" / ".cache" / "equiconvert" / "bases")


def test_no_cache_switch_keeps_decoded_data_sets_off_the_disk(tmp_path, monkeypatch) -> None:
    import numpy as np

    from equiconvert.data._base import cache_load, cache_save

    monkeypatch.setenv("EQUICONVERT_CACHE_DIR", str(tmp_path / "cache"))
    path = cache_dir() / "split.npz"
    monkeypatch.setenv("EQUICONVERT_NO_CACHE", "1")
    assert cache_save(path, images=np.zeros(3, dtype=np.uint8)) is False
    assert not path.exists()
    monkeypatch.setenv("EQUICONVERT_NO_CACHE", "0")
    assert cache_save(path, images=np.zeros(3, dtype=np.uint8)) is True
    monkeypatch.setenv("EQUICONVERT_NO_CACHE", "1")
    assert cache_load(path) is None  # an existing file is not read either
    monkeypatch.setenv("EQUICONVERT_NO_CACHE", "0")
    assert cache_load(path)["images"].shape == (3,)
