"""Symmetry groups by name ("C8", "D4") and their exact action on the pixel grid.

Only plain Python/NumPy lives here so that converted models and equivariance
checks never need escnn at run time; escnn is imported lazily by `escnn_gspace`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import torch

from .errors import GroupSpecError

MAX_ORDER = 16
_NAME = re.compile(r"^(?P<kind>[CD])(?P<n>\d+)$")


@dataclass(frozen=True)
class GridElement:
    """A group element that maps the pixel grid onto itself.

    It acts on an image by an optional horizontal flip followed by `quarter_turns`
    counter-clockwise 90-degree rotations (escnn's convention), and on a regular
    field by the channel permutation `regular_perm` (output channel
    `regular_perm[c]` receives input channel `c`).
    """

    name: str
    quarter_turns: int
    flip: bool
    regular_perm: tuple[int, ...]

    def act_on_grid(self, x: torch.Tensor) -> torch.Tensor:
        if self.flip:
            x = torch.flip(x, dims=[-1])
        return torch.rot90(x, self.quarter_turns, dims=(-2, -1))


@dataclass(frozen=True)
class GroupSpec:
    """A planar group C_N (rotations) or D_N (rotations and reflections)."""

    kind: str  # "C" or "D"
    n: int  # number of rotations

    @property
    def name(self) -> str:
        return f"{self.kind}{self.n}"

    @property
    def order(self) -> int:
        return self.n * (2 if self.kind == "D" else 1)

    def repr_size(self, representation: str) -> int:
        sizes = {"trivial": 1, "regular": self.order}
        if representation not in sizes:
            raise GroupSpecError(f"{self.name} has no representation {representation!r}; known: {sorted(sizes)}")
        return sizes[representation]

    def _index(self, flip: int, rot: int) -> int:
        return flip * self.n + rot % self.n

    def _compose(self, g: tuple[int, int], h: tuple[int, int]) -> tuple[int, int]:
        # (f, j) = rot^j * flip^f ; (f, j)(f', r) = (f + f', j + (-1)^f r)
        return ((g[0] + h[0]) % 2, (g[1] + (-1) ** g[0] * h[1]) % self.n)

    @cached_property
    def elements(self) -> tuple[tuple[int, int], ...]:
        flips = (0, 1) if self.kind == "D" else (0,)
        return tuple((f, j) for f in flips for j in range(self.n))

    @cached_property
    def grid_elements(self) -> tuple[GridElement, ...]:
        """Elements acting exactly on the pixel grid: multiples of 90 degrees and flips."""
        out = []
        for g in self.elements:
            flip, rot = g
            if (4 * rot) % self.n:
                continue
            perm = tuple(self._index(*self._compose(g, h)) for h in self.elements)
            label = f"rot{360 * rot // self.n}" + ("+flip" if flip else "")
            out.append(GridElement(label, 4 * rot // self.n, bool(flip), perm))
        return tuple(out)

    def rotation_angle(self, element: tuple[int, int]) -> float:
        """Counter-clockwise rotation angle of an element in degrees."""
        return 360.0 * element[1] / self.n

    def escnn_gspace(self):
        """The escnn gspace of this group (conversion time only)."""
        from escnn import gspaces

        if self.kind == "C":
            return gspaces.rot2dOnR2(self.n)
        return gspaces.flipRot2dOnR2(self.n)


def parse_group(group: "str | GroupSpec") -> GroupSpec:
    """Parse "C1".."C16" / "D1".."D16"; SO2/O2 will join in a later release."""
    if isinstance(group, GroupSpec):
        return group
    if not isinstance(group, str):
        raise GroupSpecError(f"group must be a name 'C1'..'C{MAX_ORDER}' or 'D1'..'D{MAX_ORDER}', got {group!r}")
    match = _NAME.match(group.strip().upper())
    if not match or not 1 <= int(match["n"]) <= MAX_ORDER:
        raise GroupSpecError(
            f"unknown group {group!r}: use 'C1'..'C{MAX_ORDER}' (rotations) or 'D1'..'D{MAX_ORDER}' "
            "(rotations and reflections)"
        )
    return GroupSpec(match["kind"], int(match["n"]))
