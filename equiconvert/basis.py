"""Steerable kernel bases: built once by equiconvert.bases, cached on disk.

A basis for (group, input representation, output representation, kernel size,
cutoff) is a float32 tensor of shape (num_basis, out_size, in_size, k, k):
every equivariant k x k filter between one input and one output field is a
linear combination of its slices. It spans the same filters as escnn's R2Conv
basis, in a canonical form that depends on nothing but these arguments (see
docs/bases.md), so checkpoints mean the same on every machine. A dilated
convolution uses the same tensor: F.conv2d places it on the dilated grid, which
90-degree rotations and flips permute as they permute the dense one.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import torch

from .bases import BUILDER_VERSION, canonical_basis, harmonic_span
from .cache import cache_root, disk_cache_enabled
from .groups import GroupSpec
from .progress import basis_built
from .errors import UnreadableFileError, UnsupportedLayerError
from .untrusted_file import load_weights_only

BASIS_FORMAT = "v4"  # bump when the way bases are stored changes (BUILDER_VERSION: how they are built)
_memory_cache: dict[str, torch.Tensor] = {}


def basis_key(group: GroupSpec, in_repr: str, out_repr: str, kernel_size: int, *, cutoff: float | None = None) -> str:
    suffix = "" if cutoff is None else f"_fco{cutoff:g}"
    return f"{group.cache_key}_{in_repr}_{out_repr}_k{kernel_size}{suffix}"


def basis_dir() -> Path:
    return cache_root() / "bases" / f"{BUILDER_VERSION}-{BASIS_FORMAT}"


def build_basis(
    group: GroupSpec, in_repr: str, out_repr: str, kernel_size: int, *, cutoff: float | None = None
) -> torch.Tensor:
    """The canonical basis, built from scratch: harmonic span, canonical form, exact grid symmetry."""
    span = harmonic_span(group, in_repr, out_repr, kernel_size, cutoff=cutoff)
    return symmetrize_on_grid(canonical_basis(span), group, in_repr, out_repr)


def _act_on_filter(filters: torch.Tensor, element, out_size: int, in_size: int) -> torch.Tensor:
    """How a grid element moves a (..., out, in, k, k) filter: rotate/flip space, permute fields."""
    moved = element.act_on_grid(filters)
    result = torch.empty_like(moved)
    out_perm = list(element.regular_perm) if out_size > 1 else [0]
    in_perm = list(element.regular_perm) if in_size > 1 else [0]
    result[..., out_perm, :, :, :] = moved
    final = torch.empty_like(result)
    final[..., :, in_perm, :, :] = result
    return final


def symmetrize_on_grid(basis: torch.Tensor, group: GroupSpec, in_repr: str, out_repr: str) -> torch.Tensor:
    """Project the basis onto filters exactly equivariant to the grid elements (see the two variants), as float32."""
    if hasattr(group, "grid_matrix"):
        return _average_with_matrices(basis, group, in_repr, out_repr)
    return _orbit_means(basis, group, in_repr, out_repr)


def _average_with_matrices(basis: torch.Tensor, group, in_repr: str, out_repr: str) -> torch.Tensor:
    """SO(2)/O(2) fields: average rho_out(g) K(g^-1 x) rho_in(g)^T over the grid elements.

    At multiples of 90 degrees the representation matrices hold only 0 and +-1, so
    every term is a signed permutation of the filter entries and the average is the
    exact projection onto the grid-equivariant filters (computed in float64).
    """
    total = torch.zeros_like(basis, dtype=torch.float64)
    for element in group.grid_elements:
        moved = element.act_on_grid(basis.double())
        rho_out, rho_in = group.grid_matrix(out_repr, element), group.grid_matrix(in_repr, element)
        total += torch.einsum("ij,bjkxy,lk->bilxy", rho_out, moved, rho_in)
    return (total / len(group.grid_elements)).float().contiguous()


def _orbit_means(basis: torch.Tensor, group: GroupSpec, in_repr: str, out_repr: str) -> torch.Tensor:
    """Make each basis filter exactly invariant under the elements acting on the pixel grid.

    Stored in float32, a basis keeps ~1e-7 equivariance error. These elements
    (rotations by 90 degrees, flips) only permute filter entries, so the equivariant
    filters are those constant on each orbit of entries: we replace every entry by
    its orbit mean, written back identically, so C4/D4 equivariance is bit-exact.
    """
    out_size, in_size = group.repr_size(out_repr), group.repr_size(in_repr)
    shape = basis.shape[1:]
    index = torch.arange(shape.numel()).reshape(shape)
    orbit = torch.stack([_act_on_filter(index, g, out_size, in_size) for g in group.grid_elements]).amin(0).flatten()
    flat = basis.double().reshape(basis.shape[0], -1)
    sums = torch.zeros_like(flat).index_add_(1, orbit, flat)
    counts = torch.zeros(flat.shape[1], dtype=torch.float64).index_add_(
        0, orbit, torch.ones(flat.shape[1], dtype=torch.float64)
    )
    means = sums / counts.clamp_min(1)
    return means[:, orbit].reshape(basis.shape).float().contiguous()


def grid_orbit_basis(group: GroupSpec, in_repr: str, out_repr: str, kernel_size: int) -> torch.Tensor:
    """The equivariant k x k filters of a group whose every element maps the pixel grid onto itself (C1, C2, C4,
    D1, D2, D4), for any k, even ones included: one unit-norm filter per orbit of filter entries (see
    _orbit_means), ordered by the orbit's first entry. Exact by construction, with no band limit to choose.

    Raises:
        UnsupportedLayerError: the group has rotations that move pixels off the grid (C8, SO2, ...).
    """
    if not hasattr(group, "elements") or len(group.grid_elements) != len(group.elements):
        raise UnsupportedLayerError(
            f"{group.name} has rotations that move pixels off the grid: its even-kernel filters have no exact "
            "basis; use C4 or D4 (or a subgroup), or an odd kernel"
        )
    out_size, in_size = group.repr_size(out_repr), group.repr_size(in_repr)
    shape = (out_size, in_size, kernel_size, kernel_size)
    index = torch.arange(math.prod(shape)).reshape(shape)
    orbit = torch.stack([_act_on_filter(index, g, out_size, in_size) for g in group.grid_elements]).amin(0).flatten()
    members = (orbit[None, :] == orbit.unique()[:, None]).float()
    return (members / members.sum(1, keepdim=True).sqrt()).reshape(-1, *shape).contiguous()


def _atomic_save(tensor: torch.Tensor, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(tensor, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def steerable_basis(
    group: GroupSpec, in_repr: str, out_repr: str, kernel_size: int, *, cutoff: float | None = None
) -> torch.Tensor:
    """Return the canonical (num_basis, out_size, in_size, k, k) basis, from memory, disk or the builder.

    cutoff: None for escnn's default band limit, or c for frequencies up to c*r per
    ring (the paper's released code uses 3, which is what its parameter counts need).
    Dilated convolutions use this basis too (the module docstring says why).
    """
    key = basis_key(group, in_repr, out_repr, kernel_size, cutoff=cutoff)
    if key in _memory_cache:
        return _memory_cache[key]
    # Real values on the CPU whatever the caller's default device: width="params" converts under
    # torch.device("meta") to count parameters, and a meta basis could be neither built, saved nor reused.
    with torch.device("cpu"):
        basis = _load_or_build(key, group, in_repr, out_repr, kernel_size, cutoff)
    _memory_cache[key] = basis
    return basis


def _load_or_build(
    key: str, group: GroupSpec, in_repr: str, out_repr: str, kernel_size: int, cutoff: float | None
) -> torch.Tensor:
    """The basis from the disk cache, else built (and saved unless the disk cache is off, cache.disk_cache_enabled)."""
    path = basis_dir() / f"{key}.pt" if disk_cache_enabled() else None
    if path is not None and path.exists():
        try:
            return load_weights_only(path, map_location="cpu")
        except UnreadableFileError:  # a corrupt cache entry is rebuilt, never trusted
            pass
    basis = build_basis(group, in_repr, out_repr, kernel_size, cutoff=cutoff)
    basis_built()  # the slow case: a progress bar counts it (progress.counting_basis_builds)
    if path is not None:
        _atomic_save(basis, path)
    return basis


def clear_memory_cache() -> None:
    """Forget bases held in memory (the disk cache stays); used by cold-start benchmarks."""
    _memory_cache.clear()
