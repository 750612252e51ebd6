"""Fusions of converted layers, on request: pairs that compute the same function as one layer.

An affine-free FieldGroupNorm whose only user is a WindowMaxPool2d becomes one FieldGroupNormMaxPool2d
(nn/norm_pool.py), which pools before it normalizes and never writes the full-size normalized tensor.
The fused layer holds the norm, so the state_dict and the export (which splits it again) are unchanged.
Conversion does not fuse: on an H200 the fusion shortens the paper model's non-private bf16 step but lengthens
its book-keeping DP step, whose host time it raises (docs/guides/performance.md).
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from ..errors import ParameterError
from ..nn import FieldGroupNorm, FieldGroupNormMaxPool2d, WindowMaxPool2d


def _norm_feeding_only(node: fx.Node, modules: dict) -> FieldGroupNorm | None:
    """The affine-free FieldGroupNorm that `node` calls, if its output goes to one place only."""
    if node.op != "call_module" or len(node.users) != 1:
        return None
    norm = modules.get(node.target)
    return norm if isinstance(norm, FieldGroupNorm) and norm.weight is None else None


def fuse_norm_pools(model: nn.Module) -> int:
    """Fuse every affine-free FieldGroupNorm -> WindowMaxPool2d pair of the traced graphs in `model` (the model
    itself or its submodules, as make_equivariant returns them) in place; returns how many.

    Raises:
        ParameterError: `model` holds no torch.fx GraphModule (nothing converted to fuse).
    """
    graphs = [module for module in model.modules() if isinstance(module, fx.GraphModule)]
    if not graphs:
        raise ParameterError(
            f"fuse_norm_pools: {type(model).__name__} holds no torch.fx GraphModule; pass a model returned by "
            "make_equivariant or create_model"
        )
    return sum(_fuse_graph(gm) for gm in graphs)


def _fuse_graph(gm: fx.GraphModule) -> int:
    modules = dict(gm.named_modules())
    fused = 0
    for node in list(gm.graph.nodes):
        pool = modules.get(node.target) if node.op == "call_module" else None
        if type(pool) is not WindowMaxPool2d or len(node.args) != 1 or node.kwargs:
            continue
        source = node.args[0]
        norm = _norm_feeding_only(source, modules) if isinstance(source, fx.Node) else None
        if norm is None:
            continue
        gm.add_submodule(node.target, FieldGroupNormMaxPool2d(norm, pool.kernel_size))
        node.args = source.args
        gm.graph.erase_node(source)
        gm.delete_submodule(source.target)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused
