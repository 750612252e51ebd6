"""Fusions after conversion: pairs of converted layers that run faster as one, with the same function.

An affine-free FieldGroupNorm whose only user is a WindowMaxPool2d becomes one FieldGroupNormMaxPool2d
(nn/norm_pool.py), which pools before it normalizes and never writes the full-size normalized tensor.
The fused layer holds the norm, so the state_dict and the export (which splits it again) are unchanged.
"""

from __future__ import annotations

import torch.fx as fx

from ..nn import FieldGroupNorm, FieldGroupNormMaxPool2d, WindowMaxPool2d


def _norm_feeding_only(node: fx.Node, modules: dict) -> FieldGroupNorm | None:
    """The affine-free FieldGroupNorm that `node` calls, if its output goes to one place only."""
    if node.op != "call_module" or len(node.users) != 1:
        return None
    norm = modules.get(node.target)
    return norm if isinstance(norm, FieldGroupNorm) and norm.weight is None else None


def fuse_norm_pools(gm: fx.GraphModule) -> int:
    """Fuse every affine-free FieldGroupNorm -> WindowMaxPool2d pair of `gm` in place; returns how many."""
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
