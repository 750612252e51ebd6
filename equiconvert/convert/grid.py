"""Which input sizes keep exact equivariance on the pixel grid.

A window op (conv or pool) with kernel k, stride s, padding p and dilation d
maps the grid onto itself under 90-degree rotations and flips exactly when its
windows are placed symmetrically: (H + 2p - d(k-1) - 1) is divisible by s.
Stride-2 3x3 convs therefore need odd sizes and 2x2 pools even ones; adaptive
pooling is always symmetric.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WindowOp:
    kernel: int
    stride: int
    padding: int
    dilation: int = 1
    ceil_mode: bool = False

    def apply(self, size: int) -> tuple[int, bool]:
        """Output size and whether the windows are symmetric at this input size."""
        span = size + 2 * self.padding - self.dilation * (self.kernel - 1) - 1
        if span < 0:
            return 0, False
        out = (math.ceil if self.ceil_mode else math.floor)(span / self.stride) + 1
        if self.ceil_mode and (out - 1) * self.stride >= size + self.padding:
            out -= 1  # PyTorch drops a last window that starts in the right padding
        return out, span % self.stride == 0


@dataclass(frozen=True)
class AdaptiveOp:
    output_size: int

    def apply(self, size: int) -> tuple[int, bool]:
        return (self.output_size, True) if size >= 1 else (0, False)


@dataclass(frozen=True)
class ScaleOp:
    """Integer upsampling: every output pixel block maps onto itself under 90-degree rotations and flips."""

    factor: int

    def apply(self, size: int) -> tuple[int, bool]:
        return size * self.factor, size >= 1


@dataclass(frozen=True)
class MinSizeOp:
    """Maps smaller than `size` are average-pooled up to it (adaptive, so symmetric); larger ones pass unchanged."""

    size: int

    def apply(self, size: int) -> tuple[int, bool]:
        return max(size, self.size), size >= 1


@dataclass(frozen=True)
class TransposedWindowOp:
    """A transposed conv without output_padding: input pixel p spreads over s p - padding + d j (0 <= j < k), so
    the output stays centred on the input at every size (the conversion refuses output_padding, which is not)."""

    kernel: int
    stride: int
    padding: int
    dilation: int = 1

    def apply(self, size: int) -> tuple[int, bool]:
        out = (size - 1) * self.stride - 2 * self.padding + self.dilation * (self.kernel - 1) + 1
        return (out, True) if out >= 1 and size >= 1 else (0, False)


SpatialOp = WindowOp | AdaptiveOp | ScaleOp | MinSizeOp | TransposedWindowOp


@dataclass(frozen=True)
class GridBreak:
    """The first node that loses exact equivariance at some input size, and why."""

    node: str
    reason: str


@dataclass
class GridAnalysis:
    valid_sizes: list[int]
    searched_up_to: int
    breaks: dict[GridBreak, int] = field(default_factory=dict)  # how many searched sizes each break is the first at

    def main_breaks(self, limit: int = 3) -> list[tuple[GridBreak, int]]:
        """The breaks that stop the most sizes, most first."""
        return sorted(self.breaks.items(), key=lambda item: -item[1])[:limit]

    def rule(self) -> str:
        """A readable description: a residue class from some size on, plus exceptions below it."""
        sizes = self.valid_sizes
        if not sizes:
            return f"no size from 8 to {self.searched_up_to} keeps exact equivariance"
        for start in range(max(len(sizes) - 2, 0)):
            tail = sizes[start:]
            step = tail[1] - tail[0]
            if all(b - a == step for a, b in zip(tail, tail[1:])):
                rule = f"H = W = {tail[0] % step} mod {step}, from {tail[0]} on"
                return rule if not start else f"H = W in {{{', '.join(map(str, sizes[:start]))}}} or {rule}"
        return f"H = W in {{{', '.join(map(str, sizes))}}}"

    def is_valid(self, size: int) -> bool:
        return size in self.valid_sizes
