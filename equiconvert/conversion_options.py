"""The names and defaults of make_equivariant's `head` and `width` options, without torch: the command line's
help and choices show them (convert/context.py and convert/width.py give them their meaning)."""

from __future__ import annotations

# The classifier head: as it was; preceded by global group pooling; or, where it flattens a spatial grid, the
# group-pooled grid averaged over the group's turns and flips (invariant; the Linear still reads every cell).
HEADS = ("keep", "invariant", "symmetric")
KEEP_HEAD, INVARIANT_HEAD, SYMMETRIC_HEAD = HEADS

PAPER_KAPPA = 1.75  # Hölzl et al.: "divide the channels by sqrt(1.75 N)"
KAPPA_WIDTH = "kappa"  # fields = floor(C * sqrt(PAPER_KAPPA * |G|) / |G|)
PARAMS = "params"  # no fixed function: make_equivariant solves for the width that keeps the parameter count
CHANNELS_WIDTH = "channels"  # fields = floor(C / |G|)
WIDTH_NAMES = (KAPPA_WIDTH, PARAMS, CHANNELS_WIDTH)  # the named width policies, in the order help lists them
DEFAULT_WIDTH = KAPPA_WIDTH

# The coordinates a weight standardization acts on: the canonical basis' coefficients (the layer's parameters) or
# escnn's R2Conv coefficients of the same filters (the paper's released code; needs the escnn extra).
STANDARDIZATION_COORDINATES = ("canonical", "escnn")
CANONICAL_COORDINATES, ESCNN_COORDINATES = STANDARDIZATION_COORDINATES

# What a conversion aims at (make_equivariant's `mode`; convert/modes.py gives each its options):
#   "full": the whole group in every layer and the paper's width rule;
#   "dp":   the conversion that wins when the converted network is trained with the original DP pipeline's own
#           hyper-parameters: fields restricted to the flips before the last stage, the original's parameter count.
MODES = ("full", "dp")
FULL_MODE, DP_MODE = MODES
DEFAULT_MODE = FULL_MODE
