"""escnn's R2Conv basis as equiconvert configures it: the reference the own builder is checked against, and the
coordinates a model standardizes its coefficients in under standardization_coordinates="escnn".

Needs the optional extra (`pip install -e '.[escnn]'` in the clone); never used to build a basis.
"""

from __future__ import annotations

import torch

from .._escnn_compat import import_escnn
from .canonical import BasisMismatchError

COORDINATES_TOLERANCE = 1e-5  # relative residual of the canonical basis in escnn's span (float32 bases: ~1e-7)
_coordinates_cache: dict[str, torch.Tensor] = {}


def escnn_basis(
    group, in_repr: str, out_repr: str, kernel_size: int, dilation: int = 1, cutoff: float | None = None
) -> torch.Tensor:
    """(num_basis, out_size, in_size, k, k) float32 basis of escnn's R2Conv, as escnn orders and scales it.

    dilation > 1 gives escnn's own dilated basis, which equiconvert does not use (docs/bases.md, "Dilated kernels").
    """
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


def escnn_coordinates(
    group, in_repr: str, out_repr: str, kernel_size: int, cutoff: float | None = None
) -> torch.Tensor:
    """(num_basis, num_basis) float64 A with escnn_coefficients = canonical_coefficients @ A for one field pair.

    escnn's R2Conv expands every (output field, input field) pair of one representation pair with the same basis,
    so one A serves a whole layer. Least squares against escnn's undilated basis, which spans the canonical basis'
    filters (a dilated layer places the same filters on its dilated grid, docs/bases.md).
    """
    from ..basis import basis_key, steerable_basis

    key = basis_key(group, in_repr, out_repr, kernel_size, cutoff=cutoff)
    if key not in _coordinates_cache:
        with torch.device("cpu"):  # escnn builds real tensors, also when a conversion runs under the meta device
            ours = steerable_basis(group, in_repr, out_repr, kernel_size, cutoff=cutoff).flatten(1).double()
            theirs = escnn_basis(group, in_repr, out_repr, kernel_size, 1, cutoff).flatten(1).double()
            if theirs.shape != ours.shape:
                raise BasisMismatchError(
                    f"{key}: escnn's basis has {theirs.shape[0]} filters, equiconvert's {ours.shape[0]}: no change of "
                    "coordinates between them"
                )
            coordinates = torch.linalg.lstsq(theirs.T, ours.T).solution.T
            residual = float((coordinates @ theirs - ours).norm() / ours.norm())
            if residual > COORDINATES_TOLERANCE:
                raise BasisMismatchError(
                    f"{key}: equiconvert's basis lies off escnn's span (relative residual {residual:.1e})"
                )
        _coordinates_cache[key] = coordinates
    return _coordinates_cache[key]
