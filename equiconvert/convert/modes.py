"""Conversion modes: named bundles of make_equivariant's `restrict` and `width`, resolved before anything converts.

"full" keeps the whole group in every layer with the paper's width rule, and makes a head that flattens a spatial
grid invariant by averaging the grid over the group's turns and flips (head="symmetric"). "dp" is the conversion that wins in public
DP pipelines trained with their own hyper-parameters (docs/guides/converting-your-dp-pipeline.md): the fields are
restricted before the last stage to the flips (D1; the trivial group for groups without reflections), so that the
classifier still sees orientation (CIFAR-10's skies are up), and the width keeps the original's parameter count, so
that the noise DP-SGD adds is spread over no more parameters than the pipeline was tuned for; a flattened grid keeps
its cells (head="keep"), as the gallery measured it. An option the user
gives explicitly always wins over the mode's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..conversion_options import DP_MODE, FULL_MODE, KEEP_HEAD, MODES, PARAMS, SYMMETRIC_HEAD
from ..errors import ParameterError
from ..groups import AnyGroupSpec
from .restrict import RestrictSpec
from .width import WidthSpec


@dataclass(frozen=True)
class ModeOptions:
    """The options a mode sets, and the sentence the report gives for them."""

    restrict: RestrictSpec
    width: WidthSpec
    head: str  # for a model that declares none; a head flattening a grid is the only one it changes
    reason: str


def _full(group: AnyGroupSpec) -> ModeOptions:
    return ModeOptions(
        None, None, SYMMETRIC_HEAD, f"equivariant to {group.name} in every layer, the paper's width rule"
    )


def _has_reflections(group: AnyGroupSpec) -> bool:
    return group.kind in ("D", "O2")


def _dp(group: AnyGroupSpec) -> ModeOptions:
    step = "reflection" if _has_reflections(group) else "invariant"
    target = "D1 (the flips)" if step == "reflection" else "the trivial group"
    return ModeOptions(
        step,
        PARAMS,
        KEEP_HEAD,  # as measured in the gallery: a flattened grid keeps its cells (the report says it is not invariant)
        f"fields restricted to {target} before the last stage and the original's parameter count kept: the "
        "conversion that trains best with a DP pipeline's own hyper-parameters",
    )


MODE_OPTIONS: dict[str, Callable[[AnyGroupSpec], ModeOptions]] = {FULL_MODE: _full, DP_MODE: _dp}
assert tuple(MODE_OPTIONS) == MODES, "conversion_options.MODES and MODE_OPTIONS name the same modes"


def resolve_mode(
    mode: str, group: AnyGroupSpec, restrict: RestrictSpec, width: WidthSpec
) -> tuple[RestrictSpec, WidthSpec, ModeOptions]:
    """(restrict, width) after the mode fills what the user left as None, and the mode's options."""
    if mode not in MODE_OPTIONS:
        raise ParameterError(f"mode={mode!r} is not a conversion mode; use one of {list(MODES)}")
    options = MODE_OPTIONS[mode](group)
    return (
        restrict if restrict is not None else options.restrict,
        width if width is not None else options.width,
        options,
    )
