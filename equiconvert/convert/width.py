"""Width policies: how many fields replace a layer's C channels.

|G| below is the group order for C_N/D_N and the size of one hidden field for
SO(2)/O(2) (GroupSpec.order / ContinuousGroupSpec.order). The paper's Table 1
counts need kappa 1.5 for C_N/D_N (with the 3r basis band limit, see
models/equivariant_resnet9.py) and kappa 1.75 for O(2).
"""

from __future__ import annotations

import math
from typing import Callable, Union

from ..conversion_options import CHANNELS_WIDTH, DEFAULT_WIDTH, KAPPA_WIDTH, PAPER_KAPPA, PARAMS
from ..errors import ParameterError
from ..groups import GroupSpec

RELEASED_CODE_KAPPA = 1.5  # hlzl/equivariant, reproduces the paper's Table 1 parameter counts

WidthFn = Callable[[int, GroupSpec], int]
WidthSpec = Union[str, float, int, WidthFn, None]


def kappa_width(kappa: float) -> WidthFn:
    """fields = floor(C * sqrt(kappa*|G|) / |G|), at least one."""

    def fields(channels: int, group: GroupSpec) -> int:
        return max(1, math.floor(channels * math.sqrt(kappa * group.order) / group.order + 1e-9))

    fields.__name__ = f"kappa={kappa}"
    return fields


def channels_width(channels: int, group: GroupSpec) -> int:
    """Keep the channel count: fields = floor(C / |G|), at least one."""
    return max(1, channels // group.order)


def multiplier_width(multiplier: float) -> WidthFn:
    """fields = floor(C * multiplier), at least one; used by the parameter-matching search."""

    def fields(channels: int, group: GroupSpec) -> int:
        return max(1, math.floor(channels * multiplier + 1e-9))

    fields.__name__ = f"multiplier={multiplier:.5f}"
    return fields


# the named width policies (conversion_options.WIDTH_NAMES); PARAMS stands for itself until make_equivariant solves it
WIDTHS: dict[str, WidthFn | str] = {
    KAPPA_WIDTH: kappa_width(PAPER_KAPPA),
    PARAMS: PARAMS,
    CHANNELS_WIDTH: channels_width,
}


def resolve_width(width: WidthSpec) -> WidthFn | str:
    """Turn the user's `width=` into a function of (channels, group), or PARAMS (solved later)."""
    if width is None:
        width = DEFAULT_WIDTH
    if isinstance(width, str) and width in WIDTHS:
        return WIDTHS[width]
    if isinstance(width, (int, float)) and not isinstance(width, bool):
        if not (math.isfinite(width) and width > 0):
            raise ParameterError(f"width kappa must be a finite number > 0, got {width}")
        return kappa_width(float(width))
    if callable(width):
        return width
    raise ParameterError(
        f"unknown width policy {width!r}: use a float kappa, one of {sorted(WIDTHS)} "
        f"({DEFAULT_WIDTH!r}, the default, is kappa {PAPER_KAPPA}), or a callable (channels, group) -> number of fields"
    )
