"""Conversion on a fresh install: bases built for the first time, under any default device, with or without a disk cache."""

import pytest
import torch
from torch import nn

import equiconvert
from equiconvert import basis
from equiconvert.cache import NO_CACHE_VARIABLE, disk_cache_enabled
from equiconvert.groups import parse_group
from equiconvert.models import resnet9


def _small_cnn() -> nn.Module:
    return resnet9(widths=(8, 16, 32))


def _convert_matching_params() -> equiconvert.EquivariantModel:
    model = equiconvert.make_equivariant(_small_cnn(), "C4", width="params", head="invariant")
    assert abs(model.report.params_after - model.report.params_before) <= 0.02 * model.report.params_before
    bases = [m.basis for m in model.modules() if hasattr(m, "basis")]
    assert bases and all(b.device.type == "cpu" and not b.is_meta for b in bases)
    assert equiconvert.check_equivariance(model, input_size=32).max_error < 1e-5
    return model


def test_params_width_builds_its_bases_on_an_empty_disk_cache(cold_cache):
    _convert_matching_params()
    assert {p.name for p in cold_cache.rglob("*.pt")} >= {"C4_trivial_regular_k3.pt", "C4_regular_regular_k3.pt"}


def test_params_width_with_no_cache_at_all_writes_nothing(cold_cache, monkeypatch):
    monkeypatch.setenv(NO_CACHE_VARIABLE, "1")
    converted = _convert_matching_params()
    assert list(cold_cache.iterdir()) == []
    first = next(m for m in converted.modules() if hasattr(m, "basis"))
    assert torch.equal(first.basis, basis.build_basis(parse_group("C4"), "trivial", "regular", 3))


@pytest.mark.parametrize("value, enabled", [("1", False), ("yes", False), ("0", True), ("", True)])
def test_the_no_cache_switch_reads_its_values(monkeypatch, value, enabled):
    monkeypatch.setenv(NO_CACHE_VARIABLE, value)
    assert disk_cache_enabled() is enabled


def test_a_no_cache_value_that_means_nothing_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(NO_CACHE_VARIABLE, "maybe")
    with pytest.raises(ValueError, match=r"\$EQUICONVERT_NO_CACHE must be 1/true/yes"):
        disk_cache_enabled()


def test_the_session_cache_is_an_empty_folder_of_its_own_not_the_users():
    from pathlib import Path

    from equiconvert.cache import cache_root

    root = cache_root()
    assert "equiconvert-test-cache-" in str(root)
    assert not root.is_relative_to(Path("~/.cache").expanduser())
