"""The FX pass that turns a CNN into a steerable CNN."""

from .context import ConversionConfig
from .core import make_equivariant
from .fuse import fuse_norm_pools
from .model import EquivariantModel
from .registry import register_function_rule, register_module_rule
from .report import ConversionReport, EquivarianceWarning

__all__ = [
    "ConversionConfig",
    "ConversionReport",
    "EquivariantModel",
    "EquivarianceWarning",
    "fuse_norm_pools",
    "make_equivariant",
    "register_function_rule",
    "register_module_rule",
]
