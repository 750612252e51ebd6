"""Steerable transposed convolution: the steerable filter, laid out for F.conv_transpose2d.

A transposed convolution adds each input pixel's K(u - s p) x(p) into the output; it commutes with a rotation or
flip g when K(g d) = rho_out(g) K(d) rho_in(g)^-1, the same constraint as a convolution's filter (-1 commutes
with every g), so the same bases serve both. Only the layout differs: conv_transpose2d takes (in, out/groups, k, k).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ParameterError
from .conv import SteerableConv2d


class SteerableConvTranspose2d(SteerableConv2d):
    """The transposed convolution of a SteerableConv2d's filter (coefficients, basis and bias are its own).

    An even kernel (a 2x2 stride-2 UNet up-sampler) is exact: its taps sit on a grid centred between pixels, and
    `output_padding` must be 0, which keeps the output centred on the input at every size.
    """

    def __init__(self, basis: torch.Tensor, in_fields: int, out_fields: int, *, output_padding: int = 0, **kwargs):
        if kwargs.get("padding_mode", "zeros") != "zeros":
            raise ParameterError("SteerableConvTranspose2d pads with zeros only, as nn.ConvTranspose2d")
        super().__init__(basis, in_fields, out_fields, **kwargs)
        self.output_padding = output_padding

    def transposed_filter(self, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The (in_channels, out_channels/groups, k, k) weight of F.conv_transpose2d, from `weight`."""
        dense = self.expand_filter(weight)  # (out_channels, in_channels/groups, k, k)
        out_per_group = self.out_channels // self.groups
        k = self.kernel_size
        grouped = dense.reshape(self.groups, out_per_group, dense.shape[1], k, k).transpose(1, 2)
        return grouped.reshape(self.in_channels, out_per_group, k, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose2d(
            x,
            self.transposed_filter(),
            self.expand_bias(),
            self.stride,
            self.padding,
            self.output_padding,
            self.groups,
            self.dilation,
        )

    def extra_repr(self) -> str:
        return f"transposed, {super().extra_repr()}, output_padding={self.output_padding}"
