"""Take images of one size to the nearest size a converted network treats exactly, symmetrically.

Rotations by 90 degrees and flips act exactly on the pixel grid, so a map from
size s to size t keeps a network exactly equivariant when it commutes with them:
symmetric zero padding (or cropping) by (t - s) // 2 pixels a side and, when t - s
is odd, one line added at the centre of each axis (the mean of the two central
lines of an even size, a copy of the central line of an odd one) or, cropping, the
two central lines merged into their mean (an odd size: the central line dropped).
Both axes get the same map, so transposes commute too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ParameterError
from ..image_shape import ImageShapeError

FIT_MODES = ("pad", "crop")


def _centre_line_indices(size: int, grow: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Source lines (a, b) of each output line: output j is the mean of lines a[j] and b[j] (size -> size +/- 1).

    b mirrors a (b[j] = size - 1 - a[out - 1 - j]), which makes the map commute with flips.
    """
    out = size + 1 if grow else size - 1
    a = [j if (2 * j < size if grow else 2 * j < size - 1) else (j - 1 if grow else j + 1) for j in range(out)]
    b = [size - 1 - a[out - 1 - j] for j in range(out)]
    return torch.tensor(a), torch.tensor(b)


class InputFit(nn.Module):
    """(N, C, size, size) -> (N, C, target, target), exactly equivariant under the grid's rotations and flips."""

    def __init__(self, size: int, target: int) -> None:
        super().__init__()
        if size < 2 or target < 1:
            raise ParameterError(f"size={size}, target={target}: cannot fit; need size >= 2 and target >= 1")
        self.size, self.target = size, target
        difference = target - size
        self.border = abs(difference) // 2  # zero padding (target > size) or crop (target < size), per side
        self.grow = difference > 0
        self.centre_line = abs(difference) % 2 == 1
        if self.centre_line:
            inner = size if self.grow else size - 2 * self.border  # the centre line is added first, merged last
            a, b = _centre_line_indices(inner, self.grow)
        else:
            a = b = torch.zeros(0, dtype=torch.long)
        self.register_buffer("line_a", a, persistent=False)
        self.register_buffer("line_b", b, persistent=False)

    def describe(self) -> str:
        side = (
            f"{self.border} pixel(s) of zero padding a side" if self.grow else f"{self.border} pixel(s) cropped a side"
        )
        line = (
            "one centre line added per axis (the mean of the two central lines; a copy of an odd size's)"
            if self.grow
            else "the two central lines of each axis merged into their mean (an odd size: the central line dropped)"
        )
        steps = [s for s, present in ((line, self.centre_line), (side, self.border > 0)) if present]
        return f"input {self.size} -> {self.target}: " + ", then ".join(steps if self.grow else steps[::-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != (self.size, self.size):
            raise ImageShapeError(
                f"this model was converted for {self.size}x{self.size} inputs (fitted to {self.target}), "
                f"got {tuple(x.shape[-2:])}"
            )
        return apply_fit(self, x)

    def extra_repr(self) -> str:
        return f"size={self.size}, target={self.target}"


def _centre(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    x = 0.5 * (x.index_select(-1, a) + x.index_select(-1, b))
    return 0.5 * (x.index_select(-2, a) + x.index_select(-2, b))


def apply_fit(fit: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """InputFit's operations on `x` (torch ops only, no size check: export traces this)."""
    if fit.grow:
        if fit.centre_line:
            x = _centre(x, fit.line_a, fit.line_b)
        return F.pad(x, (fit.border,) * 4) if fit.border else x
    if fit.border:
        x = x[..., fit.border : -fit.border, fit.border : -fit.border]
    return _centre(x, fit.line_a, fit.line_b) if fit.centre_line else x
