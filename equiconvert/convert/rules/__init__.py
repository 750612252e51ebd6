"""Importing this package registers every built-in conversion rule."""
from . import activation, channels_last, conv, head, norm, norm_act, pool, structural, upsample  # noqa: F401
