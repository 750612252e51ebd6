"""Space-to-depth (TResNet's stem) whose output channels form regular fields."""

from __future__ import annotations

import torch
from torch import nn


def space_to_depth(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, block * block * C, H / block, W / block), channels ordered (row, column, C) as timm's."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // block, block, w // block, block).permute(0, 3, 5, 1, 2, 4)
    return x.reshape(b, c * block * block, h // block, w // block)


class FieldSpaceToDepth(nn.Module):
    """Space-to-depth followed by a fixed channel permutation that groups each block's orbits into regular fields.

    A rotation of the image about its centre maps a block grid (H divisible by the block) onto itself
    and permutes the positions inside each block. Where the group acts freely on those positions
    (C2, C4), each orbit of positions of one input channel is one regular field.
    """

    def __init__(self, block: int, order: list[int]) -> None:
        super().__init__()
        self.block = block
        self.register_buffer("order", torch.tensor(order), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return space_to_depth(x, self.block)[:, self.order]

    def extra_repr(self) -> str:
        return f"block={self.block}, channels={len(self.order)}"
