"""Proof that a converted graph runs: a forward pass at the traced size and at a size the report calls valid.

The grid analysis reasons about window arithmetic only; a rule that changed a
spatial size without saying so (or a merge of branches that disagree) would
otherwise give a model that fails at run time. Conversion runs the converted
graph node by node and names the node that fails. A graph that no input size
makes exactly equivariant is refused, naming the nodes that break it, unless
the caller accepts it (allow_non_equivariant).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..errors import EquivarianceBreakError, UnsupportedLayerError
from .context import SHAPE_KEY, ConversionContext
from .grid import GridAnalysis
from .report import ConversionReport, EquivarianceWarning

MIN_CHECK_SIZE = 32  # smallest size that a check runs at when a valid one this large exists


class _NodeFailure(Exception):
    def __init__(self, node: fx.Node, cause: Exception) -> None:
        super().__init__(str(cause))
        self.node, self.cause = node, cause


class _NodeRunner(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, bar: Any = None) -> None:
        super().__init__(gm)
        self.bar = bar  # a progress bar ticked per node run, or None

    def run_node(self, n: fx.Node):
        try:
            result = super().run_node(n)
        except Exception as exc:
            raise _NodeFailure(n, exc) from exc
        if self.bar is not None:
            self.bar.update(1)
        return result


def _where(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module {node.target!r}"
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        last = list(stack.values())[-1]
        return f"inside module {last[0] if isinstance(last, tuple) else last!r}"
    return f"{node.op} {getattr(node.target, '__name__', node.target)}"


def run_at(gm: fx.GraphModule, in_channels: int, size: int, bar: Any = None) -> tuple[int, ...] | None:
    """Output shape of `gm` on a (1, in_channels, size, size) input; raises _NodeFailure naming the failing node.

    bar: a progress bar, its total raised by the graph's nodes and ticked per node run."""
    was_training = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            parameter = next(gm.parameters(), None)
            example = torch.zeros(
                1, in_channels, size, size, device=parameter.device if parameter is not None else None
            )
            if bar is not None:
                bar.total += len(gm.graph.nodes)
            out = _NodeRunner(gm, bar).run(example)
    finally:
        gm.train(was_training)
    return tuple(out.shape) if isinstance(out, torch.Tensor) else None


def preferred_valid_size(valid: list[int]) -> int | None:
    """The valid size to run a model at: the first at least MIN_CHECK_SIZE, else the largest; None if none.

    Large enough that a check sees more than a few pixels, yet as cheap as possible; `valid` is ascending.
    """
    if not valid:
        return None
    return next((s for s in valid if s >= MIN_CHECK_SIZE), valid[-1])


def verify_conversion(
    converted: fx.GraphModule,
    original: fx.GraphModule,
    report: ConversionReport,
    in_channels: int,
    bar: Any = None,
) -> None:
    """Raise UnsupportedLayerError if `converted` fails where `original` runs (bar: ticked per node run).

    `original` is the traced template with its recorded shapes: its input's size is where the original ran.
    """
    traced_size = next(n for n in original.graph.nodes if n.op == "placeholder").meta[SHAPE_KEY][-1]
    sizes = [traced_size]
    valid = preferred_valid_size(report.valid_input_sizes)
    if valid is not None and valid != traced_size:
        sizes.append(valid)
    for size in sizes:
        try:
            shape = run_at(converted, in_channels, size, bar)
        except _NodeFailure as failure:
            if size != traced_size and not _runs(original, in_channels, size):
                report.warnings.append(
                    EquivarianceWarning(
                        "",
                        "",
                        "",
                        f"the original model does not run at size {size}, which the grid analysis calls valid",
                    )
                )
                continue
            raise UnsupportedLayerError(
                f"the converted model fails at node {failure.node.name!r} ({_where(failure.node)}) on a "
                f"{size}x{size} input where the original runs ({type(failure.cause).__name__}: {failure.cause}). "
                + _failure_advice(converted, original)
            ) from failure.cause
        expected = _traced_output(original)
        if size == traced_size and expected is not None and shape is not None and shape[1:] != expected[1:]:
            raise UnsupportedLayerError(
                f"the converted model returns shape {shape} on a {size}x{size} input where the original returns "
                f"{expected}; a rule changed the output layout. Register a corrected rule for the head."
            )


def grown_kernels(converted: fx.GraphModule, original: fx.GraphModule) -> list[str]:
    """Convolutions whose even kernel became odd (even_kernels="grow"): each one shifts the feature-map sizes."""
    grown = []
    for name, module in converted.named_modules():
        kernel = getattr(module, "kernel_size", None)
        before = getattr(_submodule(original, name), "kernel_size", None)
        if isinstance(before, tuple):
            before = before[0]
        if isinstance(kernel, int) and isinstance(before, int) and before % 2 == 0 and kernel == before + 1:
            grown.append(name)
    return grown


def _submodule(gm: fx.GraphModule, name: str) -> torch.nn.Module | None:
    try:
        return gm.get_submodule(name)
    except AttributeError:
        return None


def _failure_advice(converted: fx.GraphModule, original: fx.GraphModule) -> str:
    """What the user can do about a converted graph that fails where the original runs."""
    if grown := grown_kernels(converted, original):
        return (
            f"even_kernels='grow' made the kernels of {grown} one pixel larger, which changes the feature-map sizes "
            "after them, and this node needs the original's. Options: where it flattens a grid, pass "
            "head='invariant' (pools globally before the flatten, so any grid size fits); else give those "
            "convolutions odd kernels before converting."
        )
    return (
        "A rule changed a shape without saying so. Options: replace that module before converting, or register a "
        "corrected rule with equiconvert.register_module_rule."
    )


def require_an_exact_size(
    converted: fx.GraphModule, grid: GridAnalysis, report: ConversionReport, *, allow_non_equivariant: bool
) -> None:
    """Refuse a model that no input size makes exactly equivariant, naming the nodes that break it.

    With allow_non_equivariant the model is kept and the report warns (make_equivariant issues its
    warnings as Python warnings): it is then equivariant only approximately, at every size.
    """
    if grid.valid_sizes:
        return
    nodes = {node.name: node for node in converted.graph.nodes}
    breaks = grid.main_breaks()
    where = "; ".join(
        f"node {b.node!r} ({_where(nodes[b.node])}) {b.reason} at {count} of the sizes from 8 to {grid.searched_up_to}"
        for b, count in breaks
    )
    message = f"{grid.rule()}" + (f": {where}" if where else "")
    if not allow_non_equivariant:
        raise EquivarianceBreakError(
            f"{message}. Give those layers strides, paddings and pool sizes that agree on some input size (or replace "
            "them) before converting, or pass allow_non_equivariant=True to keep a model that is equivariant only "
            "approximately at every size"
        )
    message += ": the converted model is equivariant only approximately at every size"
    if breaks:
        report.warnings.append(ConversionContext.warning_at(nodes[breaks[0][0].node], message))
    else:
        report.warnings.append(EquivarianceWarning("", "", "", message))


def _runs(gm: fx.GraphModule, in_channels: int, size: int) -> bool:
    try:
        run_at(gm, in_channels, size)
    except _NodeFailure:
        return False
    return True


def _traced_output(gm: fx.GraphModule) -> tuple[int, ...] | None:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    arg = output.args[0]
    return arg.meta.get(SHAPE_KEY) if isinstance(arg, fx.Node) else None
