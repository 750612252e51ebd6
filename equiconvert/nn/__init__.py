"""Plain-tensor equivariant modules: what a converted model is made of (no escnn objects)."""

from .conv import SteerableConv2d
from .grid_symmetrize import GridSymmetrize
from .input_fit import InputFit
from .irrep_fields import GatedNonlinearity, GroupStandardization, InvariantMap, NormMaxPool2d
from .norm import FieldGroupNorm
from .norm_pool import FieldGroupNormMaxPool2d
from .pooling import GroupPool
from .restriction import FieldRestriction, ReflectionRestriction
from .window_pool import WindowMaxPool2d

__all__ = [
    "SteerableConv2d",
    "FieldGroupNorm",
    "FieldGroupNormMaxPool2d",
    "GroupPool",
    "GridSymmetrize",
    "FieldRestriction",
    "ReflectionRestriction",
    "GatedNonlinearity",
    "GroupStandardization",
    "InvariantMap",
    "NormMaxPool2d",
    "InputFit",
    "WindowMaxPool2d",
]
