"""The converted network: a traced GraphModule plus what is known about its symmetry."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from ..errors import ParameterError
from ..groups import GroupSpec
from ..image_shape import check_image_shape
from .fields import FieldType
from .report import ConversionReport
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
