"""A feature map averaged over a group's exact actions on the pixel grid: a flattened grid made invariant."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class GridSymmetrize(nn.Module):
    """The mean of `x` over grid actions (a horizontal flip or not, then quarter turns, as GridElement acts).

    A head that flattens a spatial grid into a Linear is not invariant: a turn permutes the cells. Averaging the
    (invariant-field) map over the group's grid actions first makes the cells of one orbit equal (the four corners
    under C4), so the Linear, which still reads every cell, gives the same output for every turned or flipped
    input. Needs a square grid.
    """

    def __init__(self, actions: Sequence[tuple[int, bool]]) -> None:
        super().__init__()
        self.actions = tuple((int(turns), bool(flip)) for turns, flip in actions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(x)
        for quarter_turns, flip in self.actions:
            moved = torch.flip(x, dims=[-1]) if flip else x
            total = total + torch.rot90(moved, quarter_turns, dims=(-2, -1))
        return total / len(self.actions)

    def extra_repr(self) -> str:
        return f"elements={len(self.actions)}"
