"""Importing this package registers every built-in conversion rule."""

from . import (  # noqa: F401  (imported for their registrations)
    activation,
    blur_pool,
    channels_last,
    conv,
    conv_transpose,
    conv_mlp,
    conv_variants,
    evo_norm,
    gates,
    head,
    norm,
    norm_act,
    pad,
    path_attention,
    pool,
    space_to_depth,
    split,
    structural,
    upsample,
)
