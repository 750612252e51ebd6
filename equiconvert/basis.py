"""Steerable kernel bases, built by escnn once and cached on disk.

A basis for (input representation, output representation, kernel size,
dilation) is a float32 tensor of shape (num_basis, out_size, in_size, k, k):
every equivariant k x k filter between one input and one output field is a
linear combination of its slices. The converted model stores it as a buffer;
escnn is needed only when a basis is missing from the cache.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from ._escnn_compat import cache_root, import_escnn
from .groups import GroupSpec

BASIS_FORMAT = "v3"  # bump when the way bases are built or stored changes
_memory_cache: dict[str, torch.Tensor] = {}


def _escnn_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("escnn")
    except PackageNotFoundError:
        return "missing"


def basis_key(
    group: GroupSpec, in_repr: str, out_repr: str, kernel_size: int, dilation: int, cutoff: float | None = None
) -> str:
    suffix = "" if cutoff is None else f"_fco{cutoff:g}"
    return f"{group.cache_key}_{in_repr}_{out_repr}_k{kernel_size}_d{dilation}{suffix}"


def basis_dir() -> Path:
    return cache_root() / "bases" / f"escnn-{_escnn_version()}-{BASIS_FORMAT}"


def _build_with_escnn(
    group: GroupSpec, in_repr: str, out_repr: str, kernel_size: int, dilation: int, cutoff: float | None = None
) -> torch.Tensor:
    import_escnn()
    from escnn import nn as enn

    gspace = group.escnn_gspace()
    in_type = enn.FieldType(gspace, [group.escnn_repr(in_repr)])
    out_type = enn.FieldType(gspace, [group.escnn_repr(out_repr)])
    # cutoff c keeps angular frequencies up to c*r on the ring of radius r (escnn's default is its own _manual_fco1)
    options = {} if cutoff is None else {"frequencies_cutoff": lambda r, c=cutoff: c * r}
    conv = enn.R2Conv(in_type, out_type, kernel_size, dilation=dilation, bias=False, initialize=False, **options)
    dimension = conv.basisexpansion.dimension()
    shape = (out_type.size, in_type.size, kernel_size, kernel_size)
    if dimension == 0:
        return torch.zeros((0, *shape))
    with torch.no_grad():
        unit = torch.eye(dimension, dtype=torch.float32)
        slices = [conv.basisexpansion(unit[i]).reshape(shape) for i in range(dimension)]
    return torch.stack(slices).contiguous()


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
    """Project the basis onto filters exactly equivariant to the grid elements (see the two variants)."""
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

    escnn samples bases in float32, leaving ~1e-7 equivariance error. These elements
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
    counts = torch.zeros(flat.shape[1], dtype=torch.float64).index_add_(0, orbit, torch.ones(flat.shape[1], dtype=torch.float64))
    means = sums / counts.clamp_min(1)
    return means[:, orbit].reshape(basis.shape).float().contiguous()


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
    group: GroupSpec, in_repr: str, out_repr: str, kernel_size: int, dilation: int = 1, cutoff: float | None = None
) -> torch.Tensor:
    """Return the (num_basis, out_size, in_size, k, k) basis, from memory, disk or escnn.

    cutoff: None for escnn's default band limit, or c for frequencies up to c*r per
    ring (the paper's released code uses 3, which is what its parameter counts need).
    """
    key = basis_key(group, in_repr, out_repr, kernel_size, dilation, cutoff)
    if key in _memory_cache:
        return _memory_cache[key]
    path = basis_dir() / f"{key}.pt"
    basis = None
    if path.exists():
        try:
            basis = torch.load(path, weights_only=True)
        except Exception:  # a corrupt cache entry is rebuilt, never trusted
            basis = None
    if basis is None:
        basis = _build_with_escnn(group, in_repr, out_repr, kernel_size, dilation, cutoff)
        basis = symmetrize_on_grid(basis, group, in_repr, out_repr)
        _atomic_save(basis, path)
    _memory_cache[key] = basis
    return basis


def clear_memory_cache() -> None:
    """Forget bases held in memory (the disk cache stays); used by cold-start benchmarks."""
    _memory_cache.clear()
