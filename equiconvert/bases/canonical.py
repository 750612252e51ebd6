"""The canonical basis of a span of filters, its fingerprint, and changes of basis.

A span has one orthogonal projector P, whatever basis it is given in. The
canonical basis is Gram-Schmidt over P e_j, j in a fixed pivot order, keeping
the vectors whose residual is not (numerically) zero: it depends on the span
only, is orthonormal (so coefficient norms equal filter Frobenius norms), and
each vector is positive on the first index where it is new.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..errors import ConversionError, ParameterError


class BasisMismatchError(ConversionError, RuntimeError):
    """A state_dict's coefficients belong to another kernel basis than the layer loading them."""


class IllConditionedBasisError(ConversionError, ArithmeticError):
    """A kernel basis whose span the canonical basis cannot pin down (directions too close to the tolerance)."""


RANK_TOLERANCE = 1e-5  # singular values below this fraction of the largest are noise (float32 inputs)
PIVOT_TOLERANCE = 2e-3  # residual norm of P e_j (at most 1) needed to open a new direction; tests check the gap
FINGERPRINT_GRID = 1e-5  # fingerprints hash the basis rounded to multiples of this (far above float32 rounding)


def orthonormal_span(basis: torch.Tensor) -> torch.Tensor:
    """(D, rank) float64 orthonormal columns spanning the flattened slices of `basis`."""
    flat = basis.reshape(basis.shape[0], -1).double()
    if flat.shape[0] == 0:
        return flat.new_zeros(flat.shape[1], 0)
    _, values, vh = torch.linalg.svd(flat, full_matrices=False)
    rank = int((values > RANK_TOLERANCE * values[0]).sum()) if values.numel() and values[0] > 0 else 0
    return vh[:rank].T.contiguous()


def pivot_order(shape: tuple[int, ...]) -> torch.Tensor:
    """Flat indices of a (..., k, k) slice, pixels from the centre outwards, then in index order.

    Central pixels carry every frequency with weight near 1; corners see only Gaussian
    tails, so taking them last keeps each Gram-Schmidt step well conditioned.
    """
    k_rows, k_cols = shape[-2], shape[-1]
    rows = torch.arange(k_rows, dtype=torch.float64) - (k_rows - 1) / 2
    cols = torch.arange(k_cols, dtype=torch.float64) - (k_cols - 1) / 2
    radius = (rows[:, None] ** 2 + cols[None, :] ** 2).expand(*shape).reshape(-1)
    return torch.sort(radius, stable=True).indices


def pivot_residuals(span: torch.Tensor, shape: tuple[int, ...]) -> tuple[list[int], np.ndarray, float, float]:
    """Gram-Schmidt over P e_j in pivot order: chosen indices, coordinates, smallest kept and largest skipped residual."""
    rows = span[pivot_order(shape)].numpy()
    rank = rows.shape[1]
    chosen: list[int] = []
    vectors = np.zeros((rank, rank))
    largest_skipped, smallest_kept = 0.0, 1.0
    for j in range(rows.shape[0]):
        if len(chosen) == rank:
            break
        row = rows[j]
        residual = row - vectors[: len(chosen)].T @ (vectors[: len(chosen)] @ row)
        residual = residual - vectors[: len(chosen)].T @ (vectors[: len(chosen)] @ residual)
        norm = float(np.linalg.norm(residual))
        if norm > PIVOT_TOLERANCE:
            vectors[len(chosen)] = residual / norm
            chosen.append(j)
            smallest_kept = min(smallest_kept, norm)
        else:
            largest_skipped = max(largest_skipped, norm)
    if len(chosen) != rank:
        raise IllConditionedBasisError(
            f"canonical basis found {len(chosen)} of {rank} directions; the span is ill-conditioned"
        )
    return chosen, vectors, smallest_kept, largest_skipped


def canonical_basis(basis: torch.Tensor) -> torch.Tensor:
    """The canonical float64 basis (rank, *slice shape) of the span of `basis`'s slices."""
    span = orthonormal_span(basis)
    if span.shape[1] == 0:
        return basis.new_zeros((0, *basis.shape[1:]), dtype=torch.float64)
    _, vectors, _, _ = pivot_residuals(span, tuple(basis.shape[1:]))
    canonical = torch.from_numpy(vectors) @ span.T
    return canonical.reshape(-1, *basis.shape[1:])


def basis_fingerprint(basis: torch.Tensor) -> str:
    """First 16 hex digits of the SHA-256 of the basis rounded to FINGERPRINT_GRID (platform independent)."""
    rounded = torch.round(basis.detach().cpu().double() / FINGERPRINT_GRID).to(torch.int64)
    digest = hashlib.sha256(str(tuple(basis.shape)).encode())
    digest.update(rounded.numpy().astype("<i8").tobytes())
    return digest.hexdigest()[:16]


def reexpress_coefficients(weight: torch.Tensor, old_basis: torch.Tensor, new_basis: torch.Tensor) -> torch.Tensor:
    """Coefficients (..., new_num_basis) whose filters best match `weight` (..., old_num_basis) in the old basis.

    Least squares in filter space; exact (to rounding) when the two bases span the same filters.
    """
    if old_basis.shape[1:] != new_basis.shape[1:]:
        raise ParameterError(
            f"old_basis and new_basis act on different filters: {tuple(old_basis.shape)} vs {tuple(new_basis.shape)}"
        )
    if weight.shape[-1] != old_basis.shape[0]:
        raise ParameterError(f"weight has {weight.shape[-1]} coefficients, old_basis {old_basis.shape[0]} slices")
    old_flat = old_basis.reshape(old_basis.shape[0], -1).double()
    new_flat = new_basis.reshape(new_basis.shape[0], -1).double()
    filters = weight.detach().double().reshape(-1, old_flat.shape[0]) @ old_flat
    solution = torch.linalg.lstsq(new_flat.T, filters.T).solution.T
    return solution.reshape(*weight.shape[:-1], new_flat.shape[0]).to(weight.dtype)
