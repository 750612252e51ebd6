"""escnn's R2Conv basis as equiconvert configures it: the reference the own builder is checked against.

Needs the optional extra (`pip install equiconvert[escnn]`); never used to build a model.
"""

from __future__ import annotations

import torch

from .._escnn_compat import import_escnn


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
