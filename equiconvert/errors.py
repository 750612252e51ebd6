"""Exceptions raised by equiconvert, each naming what broke and what to do.

Every project exception derives from EquiconvertError and from one category below; the command line picks its exit
status by the category (equiconvert.cli.common.EXIT_CODES). Each class also keeps the builtin base a caller would
expect (ValueError for a bad value), so `except ValueError` still catches it. This module imports nothing.
"""


class EquiconvertError(Exception):
    """Base class of all equiconvert errors."""


# the categories: every project exception derives from exactly one of them
class UsageError(EquiconvertError):
    """A parameter, option, name or setting the caller gave cannot be used; giving another one fixes it."""


class DataError(EquiconvertError):
    """A data set, image batch or file read (checkpoint, saved model) is missing, malformed or unusable."""


class PrivacyError(EquiconvertError):
    """DP-SGD cannot keep its guarantee: a privacy budget that cannot be met, or a model it cannot train privately."""


class ConversionError(EquiconvertError):
    """A model that cannot be converted to (or loaded as) an equivariant one."""


class RunError(EquiconvertError):
    """A run failed while under way for a reason outside its inputs (a worker of the job lost)."""


class UnsupportedLayerError(ConversionError):
    """A node of the traced model has no equivariant counterpart (yet)."""


class TracingError(ConversionError):
    """torch.fx could not trace the model."""


class EquivarianceBreakError(ConversionError):
    """A construct breaks equivariance and `strict=True` was requested."""


class GroupSpecError(UsageError, ValueError):
    """A group name could not be parsed."""


class ModelNameError(UsageError, ValueError):
    """A model name the registry cannot resolve, or keyword arguments its model does not take."""


class InvalidInputSizeError(UsageError, ValueError):
    """A requested input size does not keep exact equivariance; the message lists the nearest sizes that do."""


class NotAModuleError(UsageError, TypeError):
    """A model argument that is not a torch.nn.Module (a name, a class, a state dict)."""


class ParameterError(UsageError, ValueError):
    """A parameter whose value cannot be used; the message names the parameter and what to give instead."""


class ParameterTypeError(UsageError, TypeError):
    """A parameter of a type that cannot be used; the message names the parameter and the types it takes."""


class CallOrderError(UsageError, RuntimeError):
    """A method called before what it needs has run (a forward, a backward, the call that sets it up)."""


class NameMismatchError(UsageError, KeyError):
    """A name (of a layer, a state entry, a data set) that matches none of those the call knows."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnreadableFileError(DataError, ValueError):
    """A file read with torch.load(weights_only=True) that is damaged, crafted or of another format."""


class MissingFileError(DataError, FileNotFoundError):
    """A file the call needs is not where it was looked for; the message says where it looked and what to do."""
