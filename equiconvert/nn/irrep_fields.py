"""Layers for SO(2)/O(2) fields (trivial channels first, then rotating irrep components).

Pointwise maps are not equivariant on irreps of frequency >= 1: a rotation mixes
the two coordinates of a component. These layers only ever use invariants of a
component (its norm, its gate) to act on it, and treat trivial channels like
ordinary channels. The layout comes from groups.FieldLayout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ParameterError
from ..groups import FieldLayout
from .conv import apply_to_constants
from .norm import at_least_fp32, field_groups
from .pooling import InvariantScale


def _gate_index(layout: FieldLayout) -> torch.Tensor:
    """For every non-trivial channel, the trivial channel that gates its component."""
    return torch.tensor([gate for (_, size, _, _), gate in zip(layout.components, layout.gates) for _ in range(size)])


class GatedNonlinearity(nn.Module):
    """Standard activation on trivial channels; each non-trivial component times sigmoid(its gate).

    The gate is an invariant (trivial) channel of the same field, read before the
    activation, so scaling a component by it commutes with rotating the component.
    """

    def __init__(self, num_fields: int, layout: FieldLayout, activation: nn.Module) -> None:
        super().__init__()
        self.num_fields, self.field_size, self.trivial = num_fields, layout.size, layout.trivial
        self.activation = activation
        self.register_buffer("gate_index", _gate_index(layout), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fields = x.unflatten(1, (self.num_fields, self.field_size))
        trivial, rotating = fields[:, :, : self.trivial], fields[:, :, self.trivial :]
        gates = torch.sigmoid(trivial.index_select(2, self.gate_index))
        return torch.cat([self.activation(trivial), rotating * gates], dim=2).flatten(1, 2)

    def extra_repr(self) -> str:
        return f"fields={self.num_fields}x{self.field_size}, trivial={self.trivial}"


class GroupStandardization(nn.Module):
    """Group norm for irrep fields (Hölzl et al., Eq. 5-6): one mean and one std per (sample, group).

    The mean is taken over, and subtracted from, trivial channels only: subtracting
    a constant from a rotating component is not equivariant. The std pools the
    squared trivial deviations and the squared norms of the rotating components
    (both invariant) and divides every channel alike. Optional affine: one scale
    per field on all its channels, one shift per field on its trivial channels.
    Groups are contiguous runs of whole fields (sizes differ by at most one).
    """

    def __init__(self, num_fields: int, layout: FieldLayout, num_groups: int, affine: bool = False, eps: float = 1e-5):
        super().__init__()
        if not 1 <= num_groups <= num_fields:
            raise ParameterError(f"num_groups={num_groups} must lie in 1..num_fields={num_fields}")
        self.num_fields, self.field_size, self.trivial = num_fields, layout.size, layout.trivial
        self.num_groups, self.eps = num_groups, eps
        # a constant, not a buffer: Opacus refuses trainable modules with buffers (see apply_to_constants)
        self.assignment = field_groups(num_fields, num_groups)
        self.weight = nn.Parameter(torch.ones(num_fields)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_fields)) if affine else None

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        apply_to_constants(self, fn, ("assignment",))
        return self

    def standardize(self, x: torch.Tensor) -> torch.Tensor:
        """The output before the affine step, shaped (batch, fields, field size, positions)."""
        # (B, C, ...) -> (B, fields, size, positions); unlike reshape(..., -1), also for an empty batch
        fields = x.unflatten(1, (self.num_fields, self.field_size)).unsqueeze(-1).flatten(3)
        trivial, rotating = fields[:, :, : self.trivial], fields[:, :, self.trivial :]
        per_group = self.assignment.sum(0)
        positions = fields.shape[-1]
        mean = (trivial.sum((2, 3)) @ self.assignment) / (per_group * self.trivial * positions)
        centred = trivial - (mean @ self.assignment.T)[:, :, None, None]
        squares = centred.pow(2).sum((2, 3)) + rotating.pow(2).sum((2, 3))
        var = (squares @ self.assignment) / (per_group * self.field_size * positions)
        scale = torch.rsqrt(var + self.eps) @ self.assignment.T
        return torch.cat([centred, rotating], dim=2) * scale[:, :, None, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # statistics in fp32 under bf16 autocast
            return self.normalize(at_least_fp32(x))

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Standardization and affine map in x's dtype: forward without its autocast guard (what the export traces)."""
        out = self.standardize(x)
        if self.weight is not None:
            out = out * self.weight[:, None, None]
            shift = torch.zeros(self.num_fields, self.field_size, 1, dtype=out.dtype, device=out.device)
            shift = shift.index_copy(
                1, torch.arange(self.trivial, device=out.device), self.bias[:, None, None].expand(-1, self.trivial, 1)
            )
            out = out + shift
        return out.reshape(x.shape)

    def extra_repr(self) -> str:
        return (
            f"fields={self.num_fields}x{self.field_size}, trivial={self.trivial}, num_groups={self.num_groups}, "
            f"affine={self.weight is not None}, eps={self.eps}"
        )


class NormMaxPool2d(nn.Module):
    """Max pooling for irrep fields: trivial channels pool as usual; per window each rotating
    component keeps its vector at the position where its norm is largest.

    The norm is invariant, so the winning position moves with the image and the
    kept vector rotates with it; on ties (equal norms) max_pool2d's choice is
    deterministic but not symmetric, which only matters for exactly equal norms.
    """

    def __init__(
        self,
        num_fields: int,
        layout: FieldLayout,
        kernel_size: int,
        stride: int | None = None,
        padding: int = 0,
        dilation: int = 1,
        ceil_mode: bool = False,
    ) -> None:
        super().__init__()
        self.num_fields, self.field_size, self.trivial = num_fields, layout.size, layout.trivial
        self.kernel_size, self.stride = kernel_size, stride if stride is not None else kernel_size
        self.padding, self.dilation, self.ceil_mode = padding, dilation, ceil_mode
        self.sizes = tuple(sorted({size for _, size, _, _ in layout.components}))
        order = list(range(self.trivial))  # channels in the order forward concatenates them (plain Python:
        for size in self.sizes:  # under torch.device("meta"), as width="params" builds it, tensors hold no data)
            channels = [[start + i for i in range(size)] for start, s, _, _ in layout.components if s == size]
            self.register_buffer(f"channels_{size}", torch.tensor(channels), persistent=False)  # offsets in a field
            order += [c for component in channels for c in component]
        restore = sorted(range(len(order)), key=order.__getitem__)  # argsort
        self.register_buffer("restore", torch.tensor(restore), persistent=False)

    def _pool(self, x: torch.Tensor, **kwargs):
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fields = x.unflatten(1, (self.num_fields, self.field_size))
        pieces = [self._pool(fields[:, :, : self.trivial].flatten(1, 2)).unflatten(1, (self.num_fields, self.trivial))]
        for size in self.sizes:
            channels = getattr(self, f"channels_{size}")  # (components, size)
            comps = fields[:, :, channels.flatten()].unflatten(2, channels.shape)  # (B, F, K, size, H, W)
            norms = comps.pow(2).sum(3).flatten(1, 2)  # (B, F*K, H, W)
            pooled, index = self._pool(norms, return_indices=True)
            flat = comps.flatten(4).flatten(1, 2)  # (B, F*K, size, H*W)
            index = index.flatten(2)[:, :, None, :].expand(-1, -1, size, -1)
            kept = flat.gather(3, index).unflatten(3, pooled.shape[-2:])  # (B, F*K, size, h, w)
            pieces.append(kept.unflatten(1, (self.num_fields, channels.shape[0])).flatten(2, 3))
        out = torch.cat(pieces, dim=2).index_select(2, self.restore)
        return out.flatten(1, 2)

    def extra_repr(self) -> str:
        return (
            f"fields={self.num_fields}x{self.field_size}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, ceil_mode={self.ceil_mode}"
        )


class InvariantMap(InvariantScale):
    """Each irrep field to one invariant channel: its norm (Frobenius over all its components), times `scale`.

    A max over a field's channels is not invariant for rotating components; the norm
    is. The epsilon keeps the gradient finite at zero fields. Spatial max/avg
    pooling of these invariants can follow.
    """

    def __init__(self, num_fields: int, field_size: int, eps: float = 1e-12, scale: float = 1.0) -> None:
        super().__init__()
        if not scale > 0:
            raise ParameterError(f"scale={scale!r}: the invariant map's scale must be positive")
        self.num_fields, self.field_size, self.eps, self.scale = num_fields, field_size, eps, float(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(x.unflatten(1, (self.num_fields, self.field_size)).pow(2).sum(2).add(self.eps).sqrt())

    def extra_repr(self) -> str:
        scale = f", scale={self.scale:.6g}" if self.scale != 1.0 else ""
        return f"fields={self.num_fields}x{self.field_size}{scale}"
