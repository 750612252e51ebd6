"""Field types carried by the FX graph during conversion (never at run time)."""

from __future__ import annotations

from dataclasses import dataclass

from ..groups import GroupSpec


@dataclass(frozen=True)
class FieldType:
    """`num_fields` copies of one representation, laid out field-major along the channel axis.

    `spatial` is True for (B, C, H, W) feature maps and False for (B, C) feature
    vectors after global pooling or flattening. `channels_last` marks a
    (B, H, W, C) view of a feature map (ConvNeXt's permuted MLP blocks).
    """

    group: GroupSpec
    representation: str
    num_fields: int
    spatial: bool = True
    channels_last: bool = False

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
