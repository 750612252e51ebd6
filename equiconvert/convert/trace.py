"""Symbolic tracing with leaves for every module that has a rule, and clear errors."""

from __future__ import annotations

import functools
import sys
import traceback

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

from ..errors import TracingError
from .context import SHAPE_KEY
from .registry import module_rule, traceable_form


class _Tracer(fx.Tracer):
    def __init__(self, extra_leaves: tuple[type, ...] = ()) -> None:  # no-arg form: unpickling re-traces
        super().__init__()
        self.record_stack_traces = True
        self.extra_leaves = extra_leaves

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        if module_rule(type(module)) is not None or isinstance(module, self.extra_leaves):
            return True
        return super().is_leaf_module(module, qualified_name)

    def call_module(self, module: nn.Module, forward, args, kwargs):
        form = traceable_form(type(module))
        if form is not None and not self.is_leaf_module(module, self.path_of_module(module)):
            forward = functools.partial(form, module)
        return super().call_module(module, forward, args, kwargs)


def _failing_module(model: nn.Module, tb) -> str | None:
    """Innermost module of `model` whose forward was running when tracing failed."""
    names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    found = None
    for frame, _ in traceback.walk_tb(tb):
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = f"{names[id(owner)]!r} ({type(owner).__name__})"
    return found


def trace(model: nn.Module, leaf_modules: tuple[type, ...] = ()) -> fx.GraphModule:
    """Trace `model` in eval mode into a GraphModule (a fresh copy; `model` is untouched)."""
    was_training = model.training
    model.eval()
    try:
        graph = _Tracer(tuple(leaf_modules)).trace(model)
    except Exception as exc:
        where = _failing_module(model, sys.exc_info()[2]) or type(model).__name__
        raise TracingError(
            f"torch.fx could not trace the model: module {where} broke tracing "
            f"({type(exc).__name__}: {exc}). Usually data-dependent Python control flow causes this. "
            "Mark that module as a leaf with make_equivariant(..., config={'leaf_modules': [ItsClass]}) "
            "and register a rule for it (equiconvert.register_module_rule), or make its forward traceable."
        ) from exc
    finally:
        model.train(was_training)
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    gm.eval()
    return gm


def propagate_shapes(gm: fx.GraphModule, example: torch.Tensor) -> None:
    """Record the original output shape of every node (conversion decisions need them)."""
    ShapeProp(gm).propagate(example)
    for node in gm.graph.nodes:
        meta = node.meta.get("tensor_meta")
        node.meta[SHAPE_KEY] = tuple(meta.shape) if hasattr(meta, "shape") else None
