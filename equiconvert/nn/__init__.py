"""Plain-tensor equivariant modules: what a converted model is made of (no escnn objects)."""
from .conv import SteerableConv2d
from .norm import FieldGroupNorm
from .pooling import GroupPool

__all__ = ["SteerableConv2d", "FieldGroupNorm", "GroupPool"]
