"""equiconvert: turn a CNN into a rotation/reflection-equivariant steerable CNN with one call.

The public names load on first use: `import equiconvert` (and `equiconvert --help`) imports neither torch nor
escnn until a function or class that needs them is asked for."""

import sys
from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .errors import EquivarianceBreakError, EquiconvertError, TracingError, UnsupportedLayerError

if TYPE_CHECKING:
    from .adapt import CanonicalizationError, CanonicalizedModel, canonicalize, pose_prior_loss, teach_upright_pose
    from .adapt.carry import CarryReport, carry_weights, convert_for_carrying
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
    from .export import export
    from .groups import GroupSpec, parse_group
    from .lightning import DPLightningCallback as DPLightningCallback  # not in __all__: an optional extra
    from .models import create_model, list_models, register_model
    from .privacy import make_private
    from .saved_model import load, save
    from .training import DPConfig, DPTrainer

# public name -> the submodule defining it
_EXPORTS = {
    **dict.fromkeys(
        ("CanonicalizationError", "CanonicalizedModel", "canonicalize", "pose_prior_loss", "teach_upright_pose"),
        "adapt",
    ),
    **dict.fromkeys(("CarryReport", "carry_weights", "convert_for_carrying"), "adapt.carry"),
    **dict.fromkeys(("EquivarianceResult", "check_equivariance"), "check"),
    **dict.fromkeys(
        (
            "ConversionConfig",
            "ConversionReport",
            "EquivarianceWarning",
            "EquivariantModel",
            "make_equivariant",
            "register_function_rule",
            "register_module_rule",
        ),
        "convert",
    ),
    "export": "export",
    **dict.fromkeys(("GroupSpec", "parse_group"), "groups"),
    # the optional extra equiconvert[lightning]: left out of __all__, so `from equiconvert import *` needs no Lightning
    "DPLightningCallback": "lightning",
    **dict.fromkeys(("create_model", "list_models", "register_model"), "models"),
    "make_private": "privacy",
    **dict.fromkeys(("load", "save"), "saved_model"),
    **dict.fromkeys(("DPConfig", "DPTrainer"), "training"),
}

__all__ = [
    "CanonicalizationError",
    "CanonicalizedModel",
    "CarryReport",
    "ConversionConfig",
    "ConversionReport",
    "DPConfig",
    "DPTrainer",
    "EquivarianceBreakError",
    "EquivarianceResult",
    "EquivarianceWarning",
    "EquiconvertError",
    "EquivariantModel",
    "GroupSpec",
    "TracingError",
    "UnsupportedLayerError",
    "canonicalize",
    "carry_weights",
    "check_equivariance",
    "convert_for_carrying",
    "create_model",
    "export",
    "list_models",
    "load",
    "make_equivariant",
    "make_private",
    "parse_group",
    "pose_prior_loss",
    "register_function_rule",
    "register_model",
    "register_module_rule",
    "save",
    "teach_upright_pose",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(ModuleType):
    """Importing the submodule `equiconvert.export` binds it as the package's attribute `export`, over the
    function of that name: a public name keeps its function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, ModuleType) and name in _EXPORTS and _EXPORTS[name] == name:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
