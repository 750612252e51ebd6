"""The converted network: a traced GraphModule plus what is known about its symmetry."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from ..groups import GroupSpec
from .fields import FieldType
from .report import ConversionReport


class EquivariantModel(nn.Module):
    """Wraps the converted GraphModule so that group, field types and report survive pickling."""

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
        return self.network(x)

    def default_input_size(self) -> int:
        """The requested input size if it is valid, else the first valid size at least 32."""
        report = self.report
        if report.input_size is not None and report.input_size_valid:
            return report.input_size
        candidates = [s for s in report.valid_input_sizes if s >= 32] or report.valid_input_sizes
        if not candidates:
            raise ValueError("this model has no input size that keeps exact equivariance; see model.report")
        return candidates[0]
