"""The converted network: a traced GraphModule plus what is known about its symmetry."""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx
from torch import nn

from ..errors import ParameterError
from ..groups import GroupSpec
from ..image_shape import check_image_shape
from .fields import FieldType
from .input_fit import nearest_valid_sizes
from .report import ConversionReport, EquivarianceWarning
from .verify import preferred_valid_size


class EquivariantModel(nn.Module):
    """Wraps the converted GraphModule so that group, field types and report survive pickling.

    Built by `make_equivariant`.

    Args:
        network: the converted network.
        group: the group it is equivariant to.
        in_channels: the channels of its input.
        output_type: the field type of its output; None when the output carries no field type.
        report: what the conversion did.
    """

    def __init__(
        self,
        network: fx.GraphModule,
        group: GroupSpec,
        in_channels: int,
        output_type: FieldType | None,
        report: ConversionReport,
    ) -> None:
        super().__init__()
        self.network = network
        self.group = group
        self.in_channels = in_channels
        self.output_type = output_type
        self.report = report

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.in_channels)
        warn_inexact_size(x, self.report.valid_input_sizes)
        return self.network(x)

    def default_input_size(self) -> int:
        """The requested input size if it is valid, else verify.preferred_valid_size of the valid sizes."""
        report = self.report
        if report.input_size is not None and report.input_size_valid:
            return report.input_size
        size = preferred_valid_size(report.valid_input_sizes)
        if size is None:
            raise ParameterError("this model has no input size that keeps exact equivariance; see model.report")
        return size


def check_input(x: torch.Tensor, channels: int) -> None:
    """(N, channels, H, W) images, or one clear error (a leaf call in a torch.fx trace of a wrapping module)."""
    check_image_shape(tuple(x.shape), channels)


torch.fx.wrap("check_input")

_WARNED_SIZES: set[tuple[int, ...]] = set()  # (valid sizes..., H, W) already warned about in this process


def warn_inexact_size(x: torch.Tensor, valid_sizes: list[int]) -> None:
    """Warn once per size when images of a size that breaks exact equivariance reach the model.

    The valid sizes are known up to the largest one listed; a size above it is not judged. A leaf call in a
    torch.fx trace, as check_input.
    """
    if not valid_sizes or torch.compiler.is_compiling():
        return
    height, width = int(x.shape[-2]), int(x.shape[-1])
    inexact = [s for s in (height, width) if s <= valid_sizes[-1] and s not in valid_sizes]
    if not inexact:
        return
    key = (*valid_sizes, height, width)
    if key in _WARNED_SIZES:
        return
    _WARNED_SIZES.add(key)
    nearest = [s for s in nearest_valid_sizes(inexact[0], valid_sizes) if s is not None]
    message = (
        f"images of {height}x{width} reach a model that is exactly equivariant only at sizes such as {nearest} "
        f"(model.report.valid_input_rule): at this size it is approximately equivariant. Convert with "
        f"input_size={inexact[0]}, pad_to_valid=True (or crop_to_valid=True), or resize the images"
    )
    warnings.warn(EquivarianceWarning("input", "", "", message), stacklevel=3)


torch.fx.wrap("warn_inexact_size")
