"""Exceptions raised by equiconvert, each naming what broke and what to do."""


class EquiconvertError(Exception):
    """Base class of all equiconvert errors."""


class UnsupportedLayerError(EquiconvertError):
    """A node of the traced model has no equivariant counterpart (yet)."""


class TracingError(EquiconvertError):
    """torch.fx could not trace the model."""


class EquivarianceBreakError(EquiconvertError):
    """A construct breaks equivariance and `strict=True` was requested."""


class GroupSpecError(EquiconvertError, ValueError):
    """A group name could not be parsed."""


class ModelNameError(EquiconvertError, ValueError):
    """A model name the registry cannot resolve, or keyword arguments its model does not take."""


class InvalidInputSizeError(EquiconvertError, ValueError):
    """A requested input size does not keep exact equivariance; the message lists the nearest sizes that do."""


class NotAModuleError(EquiconvertError, TypeError):
    """A model argument that is not a torch.nn.Module (a name, a class, a state dict)."""
