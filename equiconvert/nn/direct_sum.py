"""Layers for direct sums of field types: concatenated maps whose fields have different representations.

A dense network that concatenates its input image beside its feature maps carries trivial fields (the image's
channels) beside regular ones. A convolution reading such a map takes one steerable basis per summand, so each
part keeps its own, smaller, filter space; a layer that needs one representation reads it lifted: each trivial
channel copied onto every channel of a regular field, which the group permutes into itself (exact, no parameters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..bases.canonical import BasisMismatchError, basis_fingerprint
from ..errors import ParameterError
from .conv import apply_to_constants, filter_from_coefficients


class FieldLift(nn.Module):
    """Copy the channels of a map into a wider one by a fixed channel index (a trivial field onto a regular one)."""

    def __init__(self, index: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("index", index.long(), persistent=False)  # a constant, as FieldRestriction's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(1, self.index)

    def extra_repr(self) -> str:
        return f"{int(self.index.max()) + 1} -> {self.index.numel()} channels"


def lift_index(field_sizes: Sequence[tuple[int, int]], regular_size: int) -> torch.Tensor:
    """FieldLift's index for parts given as (fields, field size): fields of size 1 are copied regular_size times."""
    index, start = [], 0
    for fields, size in field_sizes:
        channels = torch.arange(start, start + fields * size)
        index.append(channels.repeat_interleave(regular_size) if size == 1 else channels)
        start += fields * size
    return torch.cat(index)


class DirectSumConv2d(nn.Module):
    """A steerable convolution reading a direct sum: for each input part its own basis and coefficients
    (`weight_<i>`, shape (out_fields, in_fields_i, num_basis_i)), their filters side by side along the input channels.
    """

    def __init__(
        self,
        bases: Sequence[torch.Tensor],
        in_fields: Sequence[int],
        out_fields: int,
        *,
        stride: int = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int = 1,
        bias: bool = True,
        init_gain: float = math.sqrt(2.0),
        bias_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if len(bases) != len(in_fields) or len(bases) < 2:
            raise ParameterError(f"need one basis per input part (two or more), got {len(bases)} for {len(in_fields)}")
        self.in_fields, self.out_fields = tuple(in_fields), out_fields
        self.out_size, self.kernel_size = int(bases[0].shape[1]), int(bases[0].shape[-1])
        self.in_sizes = tuple(int(b.shape[2]) for b in bases)
        self.in_channels = sum(n * size for n, size in zip(self.in_fields, self.in_sizes))
        self.out_channels = out_fields * self.out_size
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.init_gain, self.bias_scale = init_gain, float(bias_scale)
        self.num_parts = len(bases)
        self.basis_fingerprint = "".join(basis_fingerprint(b.float()) for b in bases)
        for i, (basis, fields) in enumerate(zip(bases, self.in_fields)):
            # constants, not buffers (see SteerableConv2d): moved by _apply, fingerprinted in the state_dict
            setattr(self, f"basis_{i}", basis.detach().clone().float())
            self.register_parameter(f"weight_{i}", nn.Parameter(torch.empty(out_fields, fields, basis.shape[0])))
        self.bias = nn.Parameter(torch.zeros(out_fields)) if bias else None
        self.reset_parameters()

    def part_weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight_{i}") for i in range(self.num_parts)]

    def part_bases(self) -> list[torch.Tensor]:
        return [getattr(self, f"basis_{i}") for i in range(self.num_parts)]

    def reset_parameters(self) -> None:
        """Each output channel's filter of squared norm init_gain^2 in expectation, shared over the parts' fields
        (SteerableConv2d's He-style scale)."""
        total_fields = sum(self.in_fields)
        with torch.no_grad():
            for weight, basis in zip(self.part_weights(), self.part_bases()):
                energy = float(basis.pow(2).sum(dim=(0, 2, 3, 4)).mean())
                weight.normal_(0.0, self.init_gain / math.sqrt(total_fields * energy))
            if self.bias is not None:
                self.bias.zero_()

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        apply_to_constants(self, fn, tuple(f"basis_{i}" for i in range(self.num_parts)))
        return self

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(list(bytes.fromhex(self.basis_fingerprint)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        found = bytes(state.tolist()).hex() if isinstance(state, torch.Tensor) else repr(state)
        if found != self.basis_fingerprint:
            raise BasisMismatchError(
                "DirectSumConv2d: the state_dict was saved with other kernel bases; load it with the equiconvert "
                "version, group and kernel size it was saved with"
            )

    def expand_filter(self) -> torch.Tensor:
        """The (out_channels, in_channels, k, k) filter of F.conv2d: each part's filter, in input channel order."""
        return torch.cat(
            [filter_from_coefficients(w, b) for w, b in zip(self.part_weights(), self.part_bases())], dim=1
        )

    def expand_bias(self) -> torch.Tensor | None:
        if self.bias is None:
            return None
        return (self.bias * self.bias_scale).repeat_interleave(self.out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.expand_filter(), self.expand_bias(), self.stride, self.padding, self.dilation)

    def extra_repr(self) -> str:
        parts = " + ".join(f"{n}x{size}" for n, size in zip(self.in_fields, self.in_sizes))
        return (
            f"fields {parts} -> {self.out_fields}x{self.out_size}, kernel={self.kernel_size}, "
            f"num_basis={[int(b.shape[0]) for b in self.part_bases()]}, stride={self.stride}, padding={self.padding}, "
            f"dilation={self.dilation}, bias={self.bias is not None}"
        )
