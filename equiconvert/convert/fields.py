"""Field types carried by the FX graph during conversion (never at run time)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..groups import GroupSpec


@dataclass(frozen=True)
class FieldType:
    """`num_fields` copies of one representation, laid out field-major along the channel axis.

    `spatial` is True for (B, C, H, W) feature maps and False for (B, C) feature
    vectors after global pooling or flattening. `channels_last` marks a
    (B, H, W, C) view of a feature map (ConvNeXt's permuted MLP blocks).
    `segments`: the maps a concatenation joined, kept while channels keep their places (activations, norms,
    pooling), so that a slice or split of the concatenation maps onto the parts it selects.
    """

    group: GroupSpec
    representation: str
    num_fields: int
    spatial: bool = True
    channels_last: bool = False
    segments: tuple["Segment", ...] = field(default=(), compare=False)

    @property
    def field_size(self) -> int:
        return self.group.repr_size(self.representation)

    @property
    def channels(self) -> int:
        return self.num_fields * self.field_size

    @property
    def is_invariant(self) -> bool:
        return self.representation == "trivial"

    def with_fields(self, num_fields: int) -> "FieldType":
        return FieldType(self.group, self.representation, num_fields, self.spatial, self.channels_last)

    def flattened(self) -> "FieldType":
        return FieldType(self.group, self.representation, self.num_fields, spatial=False)

    def permuted(self, channels_last: bool) -> "FieldType":
        return FieldType(self.group, self.representation, self.num_fields, self.spatial, channels_last)

    def describe(self) -> str:
        return f"{self.num_fields}x{self.representation}({self.field_size}) of {self.group.name}"


@dataclass(frozen=True)
class Segment:
    """One concatenated map: its channels in the original model and its (homogeneous) field type once converted.

    A map a slice kept part of names the whole map (`origin`) and where the part starts in it, so that a later cut
    falls on the fields of the whole (rules/split.py).
    """

    channels: int
    ftype: FieldType
    origin: "Segment | None" = None
    start: int = 0


@dataclass(frozen=True)
class FieldSum:
    """A direct sum of field types of one group: concatenated maps of different representations (an image's trivial
    channels beside regular fields).

    Rules marked with registry.takes_direct_sums read it; any other rule sees it lifted to regular fields first
    (convert/direct_sum.py), so every layer converts.
    """

    segments: tuple[Segment, ...]
    spatial: bool = True
    channels_last: bool = False
    representation = "direct sum"  # no representation of the group: rules that dispatch on it pass it by

    @property
    def group(self) -> GroupSpec:
        return self.segments[0].ftype.group

    @property
    def parts(self) -> tuple[FieldType, ...]:
        """The summands in channel order, neighbours of one representation merged."""
        merged: list[FieldType] = []
        for segment in self.segments:
            t = segment.ftype
            if merged and merged[-1].representation == t.representation:
                t = t.with_fields(merged.pop().num_fields + t.num_fields)
            merged.append(t)
        return tuple(merged)

    @property
    def num_fields(self) -> int:
        return sum(s.ftype.num_fields for s in self.segments)

    @property
    def channels(self) -> int:
        return sum(s.ftype.channels for s in self.segments)

    @property
    def is_invariant(self) -> bool:
        return False  # a sum has a non-trivial part: one of a single representation is a FieldType

    def describe(self) -> str:
        return " + ".join(p.describe() for p in self.parts)


def segments_of(ftype: "FieldType | FieldSum", channels: int) -> tuple[Segment, ...]:
    """The concatenated maps of a type of `channels` original channels: its recorded segments, or itself as one."""
    return ftype.segments or (Segment(channels, ftype),)


def join(segments: tuple[Segment, ...], spatial: bool = True) -> "FieldType | FieldSum":
    """The type of concatenated maps: one representation gives a FieldType (with its segments), several a FieldSum."""
    flat = tuple(s for segment in segments for s in (segment.ftype.segments or (segment,)))
    flat = tuple(replace(s, ftype=_plain(s.ftype)) for s in flat)
    first = flat[0].ftype
    if len({s.ftype.representation for s in flat}) > 1:
        return FieldSum(flat, spatial)
    total = sum(s.ftype.num_fields for s in flat)
    kept = len(flat) > 1 or flat[0].origin is not None
    return FieldType(first.group, first.representation, total, spatial, segments=flat if kept else ())


def _plain(ftype: FieldType) -> FieldType:
    return FieldType(ftype.group, ftype.representation, ftype.num_fields, ftype.spatial, ftype.channels_last)
