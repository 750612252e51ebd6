"""Symmetry groups by name ("C8", "D4") and their exact action on the pixel grid.

Only plain Python/NumPy lives here so that converted models and equivariance
checks never need escnn at run time; escnn is imported lazily by `escnn_gspace`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property

import torch

from .errors import GroupSpecError
from .group_names import GROUP_NAMES, MAX_ORDER

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

    hidden_repr = "regular"  # what convs map to: regular fields

    def bias_channels(self, representation: str) -> None:
        """Regular and trivial fields take one bias per field on all channels."""
        return None

    @property
    def cache_key(self) -> str:
        return self.name

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

    def escnn_gspace(self):
        """The escnn gspace of this group (conversion time only)."""
        from escnn import gspaces

        if self.kind == "C":
            return gspaces.rot2dOnR2(self.n)
        return gspaces.flipRot2dOnR2(self.n)

    def escnn_repr(self, representation: str):
        """escnn representation object of a representation name (conversion time only)."""
        gspace = self.escnn_gspace()
        self.repr_size(representation)  # raises for unknown names
        return gspace.trivial_repr if representation == "trivial" else gspace.regular_repr

    # --- subgroups and restriction -------------------------------------------

    def subgroup(self, target: "str | GroupSpec") -> "GroupSpec":
        """The subgroup named by `target`: "halved", "reflection", "invariant" or a group name.

        Subgroups share the rotation axis and the flip axis (axis 0), so each of
        their elements acts on the pixel grid exactly as its image in this group.
        """
        if isinstance(target, str) and target.strip().lower() in RESTRICTIONS:
            return RESTRICTIONS[target.strip().lower()](self)
        sub = parse_group(target)
        if not isinstance(sub, GroupSpec) or self.n % sub.n or (sub.kind == "D" and self.kind == "C"):
            raise GroupSpecError(f"{sub.name} is not a subgroup of {self.name}")
        return sub

    def embed(self, sub: "GroupSpec", element: tuple[int, int]) -> tuple[int, int]:
        """Image in this group of an element (flip, rotation) of the subgroup `sub`."""
        return element[0], element[1] * (self.n // sub.n)

    def restriction_index(self, sub: "GroupSpec") -> tuple[int, ...]:
        """Channel order that splits one regular field of this group into |G:H| regular fields of `sub`.

        Regular channels are indexed by group elements, and H acts on them by left
        multiplication, so each right coset Hc is one H-regular field: position h of
        that field is channel index(h c). A fixed permutation, the whole change of basis.
        """
        taken: set[int] = set()
        order: list[int] = []
        for coset in self.elements:
            if self._index(*coset) in taken:
                continue
            field = [self._index(*self._compose(self.embed(sub, h), coset)) for h in sub.elements]
            taken.update(field)
            order.extend(field)
        return tuple(order)


def _halved(group: GroupSpec) -> GroupSpec:
    if group.n % 2:
        raise GroupSpecError(f"restrict='halved' needs an even number of rotations, {group.name} has {group.n}")
    return GroupSpec(group.kind, group.n // 2)


def _reflection(group: GroupSpec) -> GroupSpec:
    if group.kind != "D":
        raise GroupSpecError(f"restrict='reflection' needs a group with reflections; {group.name} has none")
    return GroupSpec("D", 1)


RESTRICTIONS = {
    "halved": _halved,  # D_N -> D_{N/2}, C_N -> C_{N/2}
    "reflection": _reflection,  # D_N -> D_1 (the flip alone)
    "invariant": lambda group: GroupSpec("C", 1),  # -> the trivial group: plain channels
}


def parse_group(group: str | AnyGroupSpec, frequency: int | None = None) -> AnyGroupSpec:
    """Parse "C1".."C16" / "D1".."D16", or "SO2" / "O2" with a band limit `frequency` (default 1).

    Args:
        group: a group name, or a spec, returned as it is.
        frequency: the angular band limit of SO2/O2 fields; None for 1.

    Returns:
        The group's spec.

    Raises:
        GroupSpecError: an unknown group name, or a frequency below 1.
    """
    if isinstance(group, (GroupSpec, ContinuousGroupSpec)):
        return group
    if isinstance(group, str) and group.strip().upper().replace("(", "").replace(")", "") in CONTINUOUS:
        frequency = 1 if frequency is None else int(frequency)
        if frequency < 1:
            raise GroupSpecError(f"frequency must be at least 1, got {frequency}")
        return ContinuousGroupSpec(group.strip().upper().replace("(", "").replace(")", ""), frequency)
    if not isinstance(group, str):
        raise GroupSpecError(f"group must be a name ({GROUP_NAMES}), got {group!r}")
    match = _NAME.match(group.strip().upper())
    if not match or not 1 <= int(match["n"]) <= MAX_ORDER:
        raise GroupSpecError(f"unknown group {group!r}: use {GROUP_NAMES}")
    return GroupSpec(match["kind"], int(match["n"]))


# --- continuous groups SO(2) and O(2) ----------------------------------------------------------


@dataclass(frozen=True)
class FieldLayout:
    """Channel layout of one hidden field of SO(2)/O(2), trivial channels first.

    `trivial` channels (the invariant part and one gate per non-trivial component)
    take ordinary activations; each non-trivial component (irrep) is a block of
    `components[i]` = (start, size, angular frequency, is_sign) and is multiplied by
    the sigmoid of its gate channel `gates[i]`.
    """

    size: int
    trivial: int
    components: tuple[tuple[int, int, int, bool], ...]
    gates: tuple[int, ...]


def _layout(kind: str, frequency: int) -> FieldLayout:
    # SO(2): psi_0 + psi_1..psi_L. O(2): induced from them, Ind(psi_0) = trivial + sign,
    # Ind(psi_k) = 2 psi_{1,k}: the same representations up to a fixed change of basis.
    if kind == "SO2":
        irreps = [(k, False) for k in range(1, frequency + 1)]
    else:
        irreps = [(0, True)] + [(k, False) for k in range(1, frequency + 1) for _ in range(2)]
    trivial = 1 + len(irreps)
    components, start = [], trivial
    for k, sign in irreps:
        size = 1 if sign else 2
        components.append((start, size, k, sign))
        start += size
    return FieldLayout(start, trivial, tuple(components), tuple(range(1, trivial)))


@dataclass(frozen=True)
class ContinuousGroupSpec:
    """SO(2) or O(2) with hidden fields band-limited at angular `frequency` (gated fields)."""

    kind: str  # "SO2" or "O2"
    frequency: int = 1

    @property
    def name(self) -> str:
        return self.kind

    @property
    def cache_key(self) -> str:
        return f"{self.kind}L{self.frequency}"

    @cached_property
    def layout(self) -> FieldLayout:
        return _layout(self.kind, self.frequency)

    @property
    def order(self) -> int:
        """What the width rules use in place of |G|: the size of one hidden field."""
        return self.layout.size

    hidden_repr = "field"

    def bias_channels(self, representation: str) -> tuple[int, ...] | None:
        """Only trivial channels of a field may take a bias (a constant is not a rotating vector)."""
        return tuple(range(self.layout.trivial)) if representation == "field" else None

    def repr_size(self, representation: str) -> int:
        sizes = {"trivial": 1, "field": self.layout.size}
        if representation not in sizes:
            raise GroupSpecError(f"{self.name} has no representation {representation!r}; known: {sorted(sizes)}")
        return sizes[representation]

    @cached_property
    def grid_elements(self) -> tuple[GridElement, ...]:
        flips = (False, True) if self.kind == "O2" else (False,)
        return tuple(GridElement(f"rot{90 * q}" + ("+flip" if f else ""), q, f, ()) for f in flips for q in range(4))

    def field_matrix(self, representation: str, angle: float, flip: bool) -> torch.Tensor:
        """Matrix of the element rot(angle) * flip^f on one field (escnn's irreps, float64)."""
        size = self.repr_size(representation)
        matrix = torch.eye(size, dtype=torch.float64)
        if representation == "trivial":
            return matrix
        mirror = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
        for start, block, k, sign in self.layout.components:
            if sign:
                matrix[start, start] = -1.0 if flip else 1.0
                continue
            c, s = (_snap(math.cos(k * angle)), _snap(math.sin(k * angle)))
            rot = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
            matrix[start : start + 2, start : start + 2] = rot @ mirror if flip else rot
        return matrix

    def grid_matrix(self, representation: str, element: GridElement) -> torch.Tensor:
        return self.field_matrix(representation, element.quarter_turns * math.pi / 2, element.flip)

    def escnn_gspace(self):
        from escnn import gspaces

        bound = max(self.frequency, 1) * 4
        if self.kind == "SO2":
            return gspaces.rot2dOnR2(-1, maximum_frequency=bound)
        return gspaces.flipRot2dOnR2(-1, maximum_frequency=bound)

    def escnn_repr(self, representation: str):
        """The field as escnn's direct sum of irreps, in our channel order (conversion time only)."""
        from escnn.group import directsum

        gspace = self.escnn_gspace()
        group = gspace.fibergroup
        if representation == "trivial":
            return gspace.trivial_repr
        self.repr_size(representation)
        trivial = group.irrep(0) if self.kind == "SO2" else group.irrep(0, 0)
        irreps = [trivial] * self.layout.trivial
        for _, _, k, sign in self.layout.components:
            irreps.append(group.irrep(k) if self.kind == "SO2" else group.irrep(1, 0 if sign else k))
        return directsum(irreps, name=f"{self.cache_key}_field")

    def subgroup(self, target) -> GroupSpec:
        """ "invariant" (or "C1") for both groups; "reflection" (or "D1": the flip alone) for O(2).

        The flip of D1 is O(2)'s flip at angle 0, the same horizontal flip of the grid.
        """
        name = target.name if isinstance(target, GroupSpec) else str(target).strip()
        if name.lower() == "invariant" or name.upper() == "C1":
            return GroupSpec("C", 1)
        if name.lower() == "reflection" or name.upper() == "D1":
            if self.kind != "O2":
                raise GroupSpecError(f"restrict={target!r} needs reflections; {self.name} has none (use 'invariant')")
            return GroupSpec("D", 1)
        options = "'invariant'" + (" or 'reflection'" if self.kind == "O2" else "")
        raise GroupSpecError(f"{self.name} fields restrict only to {options}, not {target!r}")

    def reflection_pairs(self) -> tuple[tuple[int, int | None], ...]:
        """How one field splits under the flip: (fixed channel, negated channel or None) per D1 field.

        The flip fixes every trivial channel, negates the sign channel and acts on each
        frequency-k component (c, s) as diag(1, -1). Pairs: the invariant channel 0 with
        the sign channel (together Ind(psi_0)), each component's (c, s); the gates are
        left without a negated partner (None). Each field has as many unpaired channels
        as pairs (1 + 2L of each), see nn.restriction.ReflectionRestriction for their use.
        """
        if self.kind != "O2":
            raise GroupSpecError(f"{self.name} has no reflections")
        pairs = [(0, start) if sign else (start, start + 1) for start, _, _, sign in self.layout.components]
        return tuple(pairs) + tuple((gate, None) for gate in self.layout.gates)


CONTINUOUS = ("SO2", "O2")
AnyGroupSpec = GroupSpec | ContinuousGroupSpec  # what parse_group returns


def _snap(value: float) -> float:
    """cos/sin of multiples of 90 degrees exactly (0, +-1), so grid actions stay exact."""
    return float(round(value)) if abs(value - round(value)) < 1e-12 else value
