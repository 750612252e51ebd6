"""Steerable kernel spans for planar groups, built from circular harmonics without escnn.

The unconstrained kernel space is escnn's R2Conv space: on each ring r_i a
Gaussian radial profile exp(-(|x| - r_i)^2 / 2 sigma_i^2) times the circular
harmonics cos(f theta), sin(f theta) for 0 <= f <= F(r_i) (frequencies above 0
vanish at the origin), tensored with every (output, input) channel pair. O(2)
maps each (ring, frequency) block onto itself, so the group average
K -> mean_g rho_out(g) K(g^-1 x) rho_in(g)^T is a projector on the harmonic
coefficients of one block; its image, sampled on the k x k grid, spans exactly
the equivariant filters. SO(2)/O(2) average over C_M/D_M with M above the
highest frequency of the integrand, which is exact for trigonometric polynomials.
Positions are in units of the sampling step, so a dilated convolution uses the
same filters on its dilated grid (docs/bases.md, "Dilated kernels").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..groups import ContinuousGroupSpec, GroupSpec

BUILDER_VERSION = "harmonic-2"  # bump when the span or its canonical form changes
_DTYPE = torch.float64


@dataclass(frozen=True)
class RingLayout:
    """Rings, Gaussian widths and per-ring frequency cutoffs, as escnn's compute_basis_params sets them."""

    radii: tuple[float, ...]
    sigmas: tuple[float, ...]
    max_frequency: tuple[int, ...]  # highest harmonic kept on each ring


def _default_cutoff(kernel_size: int) -> Callable[[float], float]:
    """escnn's default band limit (_manual_fco1 of the undilated half-width)."""
    max_radius = kernel_size // 2

    def cutoff(r: float) -> float:
        if r == 0.0:
            return 0
        return min(2 * r, 2 if r == max_radius else 2 * r - (r + 1) % 2)

    return cutoff


def ring_layout(kernel_size: int, cutoff: float | None) -> RingLayout:
    n_rings = math.ceil(kernel_size / 2)
    radii = torch.linspace(0, (kernel_size - 1) // 2, n_rings).tolist()
    sigmas = [0.6] * (n_rings - 1) + [0.4]
    sigmas = [0.005 if r == 0.0 else s for r, s in zip(radii, sigmas)]
    band = _default_cutoff(kernel_size) if cutoff is None else (lambda r, c=float(cutoff): c * r)
    top = int(max(band(r) for r in radii))
    kept = tuple(max((f for f in range(top + 1) if math.fabs(f) <= band(r)), default=-1) for r in radii)
    return RingLayout(tuple(radii), tuple(sigmas), kept)


def grid_points(kernel_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of each pixel, x along columns and y up, so torch.rot90(dims=(-2, -1)) turns by +90 degrees."""
    offsets = torch.arange(kernel_size, dtype=_DTYPE) - (kernel_size - 1) / 2
    y, x = torch.meshgrid(-offsets, offsets, indexing="ij")
    return x, y


def _spatial(angle: float, flip: bool) -> torch.Tensor:
    """rot(angle) * flip, with the flip mirroring x (the grid's horizontal flip)."""
    c, s = math.cos(angle), math.sin(angle)
    rot = torch.tensor([[c, -s], [s, c]], dtype=_DTYPE)
    return rot @ torch.diag(torch.tensor([-1.0 if flip else 1.0, 1.0], dtype=_DTYPE))


def _harmonics(angles: torch.Tensor, f: int) -> torch.Tensor:
    if f == 0:
        return torch.ones(*angles.shape, 1, dtype=_DTYPE)
    return torch.stack([torch.cos(f * angles), torch.sin(f * angles)], dim=-1)


def _harmonic_action(f: int, matrix: torch.Tensor) -> torch.Tensor:
    """A with h_f(theta(g^-1 u)) . w = h_f(theta(u)) . (A w): how g moves harmonic coefficients w."""
    angles = torch.arange(4 * f + 4, dtype=_DTYPE) * (2 * math.pi / (4 * f + 4))
    points = torch.stack([torch.cos(angles), torch.sin(angles)])
    moved = torch.linalg.solve(matrix, points)
    design = _harmonics(angles, f)
    return torch.linalg.lstsq(design, _harmonics(torch.atan2(moved[1], moved[0]), f)).solution.contiguous()


def _regular_matrix(group: GroupSpec, element: tuple[int, int]) -> torch.Tensor:
    perm = [group._index(*group._compose(element, h)) for h in group.elements]
    matrix = torch.zeros(group.order, group.order, dtype=_DTYPE)
    matrix[perm, list(range(group.order))] = 1.0
    return matrix


def group_elements(group, representations: tuple[str, ...], degree: int):
    """(spatial matrix, {representation: matrix}) for every element the average runs over.

    Finite groups: all their elements. SO(2)/O(2): C_M/D_M with M > degree, the
    highest frequency of the averaged integrand.
    """
    if isinstance(group, GroupSpec):
        for flip, rot in group.elements:
            reps = {
                name: _regular_matrix(group, (flip, rot)) if name == "regular" else torch.eye(1, dtype=_DTYPE)
                for name in representations
            }
            yield _spatial(2 * math.pi * rot / group.n, bool(flip)), reps
        return
    assert isinstance(group, ContinuousGroupSpec)
    m = degree + 1
    flips = (False, True) if group.kind == "O2" else (False,)
    for flip in flips:
        for step in range(m):
            angle = 2 * math.pi * step / m
            reps = {name: group.field_matrix(name, angle, flip) for name in representations}
            yield _spatial(angle, flip), reps


def _field_frequency(group, representation: str) -> int:
    if isinstance(group, ContinuousGroupSpec) and representation != "trivial":
        return group.frequency
    return 0


def _probes(group, in_repr: str, out_repr: str, width: int) -> torch.Tensor:
    """Unit coefficient tensors whose averages span all equivariant ones.

    The average is invariant under the group's action, and a regular output field
    is moved onto its first channel by some element, so for a regular output the
    probes on output channel 0 suffice (|G| times fewer); otherwise all of them.
    """
    out_size, in_size = group.repr_size(out_repr), group.repr_size(in_repr)
    full = torch.eye(out_size * in_size * width, dtype=_DTYPE).reshape(-1, out_size, in_size, width)
    if isinstance(group, GroupSpec) and out_repr == "regular":
        return full[: in_size * width]
    return full


def equivariant_coefficients(group, in_repr: str, out_repr: str, f: int) -> torch.Tensor:
    """Orthonormal columns spanning the equivariant (out, in, harmonic) coefficients at frequency f."""
    width = 1 if f == 0 else 2
    degree = f + _field_frequency(group, in_repr) + _field_frequency(group, out_repr)
    probes = _probes(group, in_repr, out_repr, width)
    total = torch.zeros_like(probes)
    count = 0
    for matrix, reps in group_elements(group, (in_repr, out_repr), degree):
        action = _harmonic_action(f, matrix)
        moved = torch.einsum("sk,nijk->nijs", action, probes)  # one factor at a time: no |probes|^2 intermediate
        moved = torch.einsum("bj,nijs->nibs", reps[in_repr], moved)
        total += torch.einsum("ai,nibs->nabs", reps[out_repr], moved)
        count += 1
    averaged = (total / count).reshape(total.shape[0], -1)
    _, values, vh = torch.linalg.svd(averaged, full_matrices=False)
    return vh[values > 1e-8].T  # averages of unit probes: singular values are O(1/|G|) or rounding noise


def harmonic_span(group, in_repr: str, out_repr: str, kernel_size: int, *, cutoff: float | None) -> torch.Tensor:
    """Filters (n, out, in, k, k), float64, spanning escnn's (undilated) R2Conv basis (not yet canonical).

    In units of the sampling step: a dilated convolution samples the same filter on its dilated grid
    (docs/bases.md, "Dilated kernels").
    """
    out_size, in_size = group.repr_size(out_repr), group.repr_size(in_repr)
    layout = ring_layout(kernel_size, cutoff)
    x, y = grid_points(kernel_size)
    radius, angle = torch.sqrt(x**2 + y**2), torch.atan2(y, x)
    origin = radius < 1e-9
    solutions: dict[int, torch.Tensor] = {}
    filters = []
    for r, sigma, top in zip(layout.radii, layout.sigmas, layout.max_frequency):
        profile = torch.exp(-0.5 * (radius - r) ** 2 / sigma**2)
        for f in range(top + 1):
            if f not in solutions:
                solutions[f] = equivariant_coefficients(group, in_repr, out_repr, f)
            harmonics = _harmonics(angle, f) * profile[..., None]
            if f > 0:
                harmonics[origin] = 0.0
            coeffs = solutions[f].T.reshape(-1, out_size, in_size, harmonics.shape[-1])
            filters.append(torch.einsum("noic,yxc->noiyx", coeffs, harmonics))
    if not filters:
        return torch.zeros(0, out_size, in_size, kernel_size, kernel_size, dtype=_DTYPE)
    return torch.cat(filters)
