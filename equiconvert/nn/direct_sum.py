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
        channels = torch.arange(start, start + fields * size, device="cpu")  # a constant, also while counting on meta
        index.append(channels.repeat_interleave(regular_size) if size == 1 else channels)
        start += fields * size
    return torch.cat(index)


class DirectSumConv2d(nn.Module):
    """A steerable convolution between direct sums: for each (output part j, input part i) its own basis and
    coefficients (`weight_<j>_<i>`, shape (out_fields_j, in_fields_i, num_basis)), the filters laid out as a block
    matrix along the output and input channels; one bias per output field (`bias_<j>`)."""

    def __init__(
        self,
        bases: Sequence[Sequence[torch.Tensor]],
        in_fields: Sequence[int],
        out_fields: Sequence[int],
        *,
        stride: int = 1,
        padding: int | tuple[int, int] = 0,
        dilation: int = 1,
        bias: bool = True,
        init_gain: float = math.sqrt(2.0),
        bias_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if len(bases) != len(out_fields) or any(len(row) != len(in_fields) for row in bases):
            raise ParameterError(f"need a basis per (output part, input part): {len(out_fields)} x {len(in_fields)}")
        if len(in_fields) * len(out_fields) < 2:
            raise ParameterError("a direct sum has two parts or more on one side; use SteerableConv2d")
        self.in_fields, self.out_fields = tuple(in_fields), tuple(out_fields)
        self.in_sizes = tuple(int(b.shape[2]) for b in bases[0])
        self.out_sizes = tuple(int(row[0].shape[1]) for row in bases)
        self.kernel_size = int(bases[0][0].shape[-1])
        self.in_channels = sum(n * size for n, size in zip(self.in_fields, self.in_sizes))
        self.out_channels = sum(n * size for n, size in zip(self.out_fields, self.out_sizes))
        self.stride, self.padding, self.dilation = stride, padding, dilation
        self.init_gain, self.bias_scale = init_gain, float(bias_scale)
        self.blocks = [(j, i) for j in range(len(out_fields)) for i in range(len(in_fields))]
        self.basis_fingerprint = "".join(basis_fingerprint(bases[j][i].float()) for j, i in self.blocks)
        for j, i in self.blocks:
            # constants, not buffers (see SteerableConv2d): moved by _apply, fingerprinted in the state_dict
            setattr(self, f"basis_{j}_{i}", bases[j][i].detach().clone().float())
            shape = (out_fields[j], in_fields[i], bases[j][i].shape[0])
            self.register_parameter(f"weight_{j}_{i}", nn.Parameter(torch.empty(shape)))
        for j, fields in enumerate(out_fields):
            self.register_parameter(f"bias_{j}", nn.Parameter(torch.zeros(fields)) if bias else None)
        self.reset_parameters()

    def weight(self, j: int, i: int) -> torch.Tensor:
        return getattr(self, f"weight_{j}_{i}")

    def basis(self, j: int, i: int) -> torch.Tensor:
        return getattr(self, f"basis_{j}_{i}")

    def reset_parameters(self) -> None:
        """Each output channel's filter of squared norm init_gain^2 in expectation, shared over the input fields
        (SteerableConv2d's He-style scale)."""
        total_fields = sum(self.in_fields)
        with torch.no_grad():
            for j, i in self.blocks:
                energy = float(self.basis(j, i).pow(2).sum(dim=(0, 2, 3, 4)).mean())
                self.weight(j, i).normal_(0.0, self.init_gain / math.sqrt(total_fields * energy))
            for j in range(len(self.out_fields)):
                if getattr(self, f"bias_{j}") is not None:
                    getattr(self, f"bias_{j}").zero_()

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        apply_to_constants(self, fn, tuple(f"basis_{j}_{i}" for j, i in self.blocks))
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
        """The (out_channels, in_channels, k, k) filter of F.conv2d: the blocks in output and input channel order."""
        rows = [
            torch.cat(
                [filter_from_coefficients(self.weight(j, i), self.basis(j, i)) for i in range(len(self.in_fields))], 1
            )
            for j in range(len(self.out_fields))
        ]
        return torch.cat(rows, 0)

    def expand_bias(self) -> torch.Tensor | None:
        """One bias per output field on all its channels (invariant for trivial and regular fields)."""
        biases = [getattr(self, f"bias_{j}") for j in range(len(self.out_fields))]
        if biases[0] is None:
            return None
        return torch.cat([b.repeat_interleave(size) for b, size in zip(biases, self.out_sizes)]) * self.bias_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.expand_filter(), self.expand_bias(), self.stride, self.padding, self.dilation)

    def extra_repr(self) -> str:
        def parts(fields, sizes):
            return " + ".join(f"{n}x{size}" for n, size in zip(fields, sizes))

        return (
            f"fields {parts(self.in_fields, self.in_sizes)} -> {parts(self.out_fields, self.out_sizes)}, "
            f"kernel={self.kernel_size}, num_basis={[int(self.basis(j, i).shape[0]) for j, i in self.blocks]}, "
            f"stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
            f"bias={self.bias_0 is not None}"
        )
