"""Kernel bases: exact grid equivariance, disk cache outside site-packages, scikit-learn safety."""

import importlib.metadata
import os

import pytest
import torch

from equiconvert import basis as basis_module
from equiconvert.basis import steerable_basis, symmetrize_on_grid
from equiconvert._escnn_compat import import_escnn
from equiconvert.groups import parse_group


def _permutation(perm, size):
    matrix = torch.zeros(size, size, dtype=torch.float64)
    if size == 1:
        return matrix.fill_(1.0)
    matrix[list(perm), list(range(size))] = 1.0
    return matrix


@pytest.mark.parametrize("group_name", ["C4", "D4", "C8", "D1"])
@pytest.mark.parametrize("in_repr", ["trivial", "regular"])
@pytest.mark.parametrize("out_repr", ["trivial", "regular"])
def test_basis_is_exactly_equivariant_on_grid(group_name, in_repr, out_repr):
    group = parse_group(group_name)
    basis = steerable_basis(group, in_repr, out_repr, 5).double()
    assert basis.shape[1:] == (group.repr_size(out_repr), group.repr_size(in_repr), 5, 5)
    assert basis.shape[0] > 0
    for element in group.grid_elements:
        moved = torch.einsum(
            "po,boiyx,qi->bpqyx",
            _permutation(element.regular_perm, basis.shape[1]),
            element.act_on_grid(basis),
            _permutation(element.regular_perm, basis.shape[2]),
        )
        assert torch.equal(moved.float(), basis.float()), element.name


def test_basis_slices_are_linearly_independent():
    basis = steerable_basis(parse_group("D4"), "regular", "regular", 3)
    flat = basis.reshape(basis.shape[0], -1).double()
    assert torch.linalg.matrix_rank(flat) == basis.shape[0]


def test_symmetrize_projects_onto_equivariant_filters():
    group = parse_group("C4")
    noise = torch.randn(3, 4, 1, 3, 3)
    projected = symmetrize_on_grid(noise, group, "trivial", "regular")
    again = symmetrize_on_grid(projected, group, "trivial", "regular")
    assert torch.allclose(projected, again, atol=1e-6)  # a projection is idempotent
    assert not torch.allclose(projected, noise, atol=1e-2)


def test_cold_build_needs_no_escnn_and_is_keyed_on_the_builder(cold_cache, monkeypatch):
    import sys

    from equiconvert.bases import BUILDER_VERSION

    monkeypatch.setitem(sys.modules, "escnn", None)  # any import of escnn now fails
    basis = steerable_basis(parse_group("D4"), "regular", "regular", 3)
    assert basis.shape == (48, 8, 8, 3, 3)
    files = list(cold_cache.rglob("D4_regular_regular_k3.pt"))
    assert len(files) == 1
    assert files[0].parent.name == f"{BUILDER_VERSION}-{basis_module.BASIS_FORMAT}"


def test_cold_build_with_recent_scikit_learn(cold_cache):
    """escnn 1.0.11 alone crashes here (np.matrix into randomized_svd); our patch must not."""
    import_escnn()  # the extra is what this checks (installed by the set-up)
    import sklearn  # noqa: F401  (present on purpose)

    from equiconvert.bases.escnn_reference import escnn_basis

    major, minor = (int(p) for p in importlib.metadata.version("scikit-learn").split(".")[:2])
    assert (major, minor) >= (1, 2), "this test is only meaningful with scikit-learn >= 1.2"
    assert escnn_basis(parse_group("D4"), "regular", "regular", 3).shape == (48, 8, 8, 3, 3)


def test_escnn_joblib_cache_redirected_out_of_site_packages(cold_cache):
    import_escnn()  # the extra is what this checks (installed by the set-up)
    from equiconvert.cache import cache_root

    import_escnn()
    import escnn.group._clebsh_gordan as cg

    location = str(cg._clebsh_gordan_tensor.store_backend.location)
    assert "site-packages" not in location
    assert location.startswith(str(cache_root().parent)) or "equiconvert" in location


def test_disk_cache_hit_and_corrupt_entry_rebuilt(cold_cache):
    group = parse_group("C4")
    first = steerable_basis(group, "trivial", "regular", 3)
    path = next(cold_cache.rglob("C4_trivial_regular_k3.pt"))
    basis_module.clear_memory_cache()
    mtime = os.path.getmtime(path)
    assert torch.equal(steerable_basis(group, "trivial", "regular", 3), first)
    assert os.path.getmtime(path) == mtime  # read, not rebuilt
    path.write_bytes(b"not a tensor")
    basis_module.clear_memory_cache()
    assert torch.equal(steerable_basis(group, "trivial", "regular", 3), first)
