"""Importing this package registers every built-in conversion rule."""
from . import activation, conv, head, norm, pool, structural  # noqa: F401
