"""equiconvert: turn a CNN into a rotation/reflection-equivariant steerable CNN with one call."""

from .adapt import CanonicalizationError, CanonicalizedModel, canonicalize, pose_prior_loss
from .check import EquivarianceResult, check_equivariance
from .convert import (
    ConversionConfig,
    ConversionReport,
    EquivarianceWarning,
    EquivariantModel,
    make_equivariant,
    register_function_rule,
    register_module_rule,
)
from .errors import EquivarianceBreakError, EquiconvertError, TracingError, UnsupportedLayerError
from .export import export
from .groups import GroupSpec, parse_group
from .models import create_model, list_models, register_model
from .saved_model import load, save

from ._version import __version__ as __version__

__all__ = [
    "CanonicalizationError",
    "CanonicalizedModel",
    "ConversionConfig",
    "ConversionReport",
    "EquivarianceBreakError",
    "EquivarianceResult",
    "EquivarianceWarning",
    "EquiconvertError",
    "EquivariantModel",
    "GroupSpec",
    "TracingError",
    "UnsupportedLayerError",
    "canonicalize",
    "check_equivariance",
    "create_model",
    "export",
    "list_models",
    "load",
    "make_equivariant",
    "parse_group",
    "pose_prior_loss",
    "register_function_rule",
    "register_model",
    "register_module_rule",
    "save",
]
