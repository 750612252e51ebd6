"""A requested input size the network cannot treat exactly: refuse it, or fit it to the nearest valid one.

`fit_input` inserts an `nn.InputFit` in front of the traced network (a call_module node
after the input placeholder), so the converted model takes the requested size and
the network sees the nearest valid size at or above it ("pad") or at or below it ("crop").
"""

from __future__ import annotations

from torch import fx

from ..errors import InvalidInputSizeError, ParameterError
from ..nn.input_fit import FIT_MODES, InputFit
from .context import TYPE_KEY
from .grid import GridAnalysis
from .report import ConversionReport, LayerChange

FIT_MODULE = "input_fit"


def nearest_valid_sizes(size: int, valid_sizes: list[int]) -> tuple[int | None, int | None]:
    """The largest valid size <= `size` and the smallest >= `size` (None where there is none)."""
    below = [s for s in valid_sizes if s <= size]
    above = [s for s in valid_sizes if s >= size]
    return (below[-1] if below else None), (above[0] if above else None)


def invalid_size_error(size: int, grid: GridAnalysis) -> InvalidInputSizeError:
    below, above = nearest_valid_sizes(size, grid.valid_sizes)
    nearest = ", ".join(str(s) for s in (below, above) if s is not None) or "none"
    return InvalidInputSizeError(
        f"input size {size} does not keep exact equivariance (valid: {grid.rule()}; nearest: {nearest}). Pass "
        "pad_to_valid=True to pad it symmetrically to the next valid size, crop_to_valid=True "
        "to crop it to the previous one, or an input size that is valid"
    )


def fit_input(gm: fx.GraphModule, report: ConversionReport, size: int, grid: GridAnalysis, mode: str) -> None:
    """Insert InputFit(size -> nearest valid size in direction `mode`) before the network; record it in `report`."""
    if mode not in FIT_MODES:
        raise ParameterError(f"input fit must be one of {FIT_MODES}, got {mode!r}")
    below, above = nearest_valid_sizes(size, grid.valid_sizes)
    target = above if mode == "pad" else below
    if target is None:
        raise invalid_size_error(size, grid)
    if hasattr(gm, FIT_MODULE):
        raise ParameterError(f"the model already has a submodule named {FIT_MODULE!r}; cannot insert the input fit")
    module = InputFit(size, target)
    gm.add_submodule(FIT_MODULE, module)
    placeholder = next(node for node in gm.graph.nodes if node.op == "placeholder")
    with gm.graph.inserting_after(placeholder):
        fitted = gm.graph.call_module(FIT_MODULE, (placeholder,))
    fitted.meta[TYPE_KEY] = placeholder.meta.get(TYPE_KEY)
    placeholder.replace_all_uses_with(fitted, delete_user_cb=lambda user: user is not fitted)
    gm.graph.lint()
    gm.recompile()
    report.layers.insert(0, LayerChange(FIT_MODULE, FIT_MODULE, "(inserted)", repr(module)))
    report.input_fit = module.describe()
    report.input_size_valid = True
    report.valid_input_sizes = [size]
    report.valid_input_rule = f"H = W = {size} only (fitted to {target}; the network itself: {grid.rule()})"
