"""Elementwise activations: they commute with the channel permutations of regular fields.

In-place variants become out-of-place so that per-sample gradient machinery
(torch.func, Opacus hooks) sees every intermediate tensor.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..context import ConversionContext
from ..fields import FieldSum, FieldType
from ...nn import GatedNonlinearity
from ..registry import head_transparent, register_function_rule, register_module_rule, takes_direct_sums

POINTWISE_REPRESENTATIONS = ("trivial", "regular")
# representation -> builder(field type, activation module) of the equivariant nonlinearity that replaces it
FIELD_NONLINEARITIES = {
    "field": lambda t, activation: GatedNonlinearity(t.num_fields, t.group.layout, activation),
}

ACTIVATION_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
    nn.Hardtanh,
)
ACTIVATION_FUNCTIONS = (
    F.relu,
    F.relu6,
    F.leaky_relu,
    F.elu,
    F.selu,
    F.celu,
    F.gelu,
    F.silu,
    F.mish,
    F.hardswish,
    F.hardsigmoid,
    F.sigmoid,
    F.tanh,
    F.softplus,
    F.hardtanh,
    torch.relu,
    torch.sigmoid,
    torch.tanh,
    torch.selu,
    torch.celu,
)
ACTIVATION_METHODS = ("relu", "sigmoid", "tanh")
IN_PLACE_FUNCTIONS = {
    F.relu_: F.relu,
    torch.relu_: torch.relu,
    F.leaky_relu_: F.leaky_relu,
    F.elu_: F.elu,
    torch.selu_: torch.selu,
    torch.celu_: torch.celu,
    torch.sigmoid_: torch.sigmoid,
    torch.tanh_: torch.tanh,
}
IN_PLACE_METHODS = {"relu_": "relu", "sigmoid_": "sigmoid", "tanh_": "tanh"}


def require_pointwise(ctx: ConversionContext, node: fx.Node) -> FieldType | FieldSum:
    t_in = ctx.field_input(node)
    parts = t_in.parts if isinstance(t_in, FieldSum) else (t_in,)  # a direct sum: pointwise where every part is
    for part in parts:
        if part.representation not in POINTWISE_REPRESENTATIONS:
            raise ctx.unsupported(node, f"a pointwise activation is not equivariant on {part.representation} fields")
    return t_in


def out_of_place(module: nn.Module) -> nn.Module:
    """`module`, or a copy of it that does not act in place: a converted graph never overwrites its tensors."""
    if getattr(module, "inplace", False):
        module = copy.deepcopy(module)
        module.inplace = False
    return module


@register_module_rule(*ACTIVATION_MODULES)
@head_transparent
@takes_direct_sums
def convert_activation_module(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t_in = ctx.field_input(node)
    module = ctx.module(node)
    if t_in.representation in FIELD_NONLINEARITIES:
        gated = FIELD_NONLINEARITIES[t_in.representation](t_in, out_of_place(module))
        ctx.replace_module(node, gated)
        return t_in
    t_in = require_pointwise(ctx, node)
    if getattr(module, "inplace", False):
        ctx.replace_module(node, out_of_place(module))
    return t_in


@register_module_rule(GatedNonlinearity)
def convert_shared_gate(ctx: ConversionContext, node: fx.Node) -> FieldType:
    """A module called twice (torchvision's BasicBlock.relu) was replaced at its first call."""
    t_in, gated = ctx.field_input(node), ctx.module(node)
    if (gated.num_fields, gated.field_size) != (t_in.num_fields, t_in.field_size):
        rebuilt = FIELD_NONLINEARITIES[t_in.representation](t_in, copy.deepcopy(gated.activation))
        ctx.call_module_instead(node, rebuilt, "gated")
    return t_in


# functional activations on irrep fields become the module form inside a gated nonlinearity
FUNCTION_MODULES = {
    F.relu: nn.ReLU,
    torch.relu: nn.ReLU,
    "relu": nn.ReLU,
    F.relu_: nn.ReLU,
    torch.relu_: nn.ReLU,
    "relu_": nn.ReLU,
    F.gelu: nn.GELU,
    F.silu: nn.SiLU,
    F.mish: nn.Mish,
    F.elu: nn.ELU,
    F.sigmoid: nn.Sigmoid,
    torch.sigmoid: nn.Sigmoid,
    F.tanh: nn.Tanh,
    torch.tanh: nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    F.relu6: nn.ReLU6,
    F.hardswish: nn.Hardswish,
    F.leaky_relu: nn.LeakyReLU,
}


def _gate_function(ctx: ConversionContext, node: fx.Node, t_in: FieldType) -> FieldType:
    module_type = FUNCTION_MODULES.get(node.target)
    if module_type is None or len(node.args) > 1 or set(node.kwargs) - {"inplace"}:
        raise ctx.unsupported(
            node,
            f"a functional activation with arguments cannot gate {t_in.representation} fields",
            "Options: use the activation's nn.Module form (e.g. nn.ReLU()) before converting.",
        )
    ctx.call_module_instead(node, FIELD_NONLINEARITIES[t_in.representation](t_in, module_type()), "gated")
    return t_in


@register_module_rule(nn.PReLU)
@takes_direct_sums
def convert_prelu(ctx: ConversionContext, node: fx.Node) -> FieldType:
    if ctx.module(node).num_parameters != 1:
        raise ctx.unsupported(
            node,
            "PReLU with one slope per channel would differ within a field",
            "Options: use nn.PReLU() with a single slope, or another activation.",
        )
    return require_pointwise(ctx, node)


@register_function_rule(*ACTIVATION_FUNCTIONS, *ACTIVATION_METHODS)
@head_transparent
@takes_direct_sums
def convert_activation_function(ctx: ConversionContext, node: fx.Node) -> FieldType:
    if ctx.field_input(node).representation in FIELD_NONLINEARITIES:
        return _gate_function(ctx, node, ctx.field_input(node))
    t_in = require_pointwise(ctx, node)
    if node.kwargs.get("inplace"):
        node.kwargs = {**node.kwargs, "inplace": False}
    return t_in


@register_function_rule(*IN_PLACE_FUNCTIONS, *IN_PLACE_METHODS)
@head_transparent
@takes_direct_sums
def convert_in_place_activation(ctx: ConversionContext, node: fx.Node) -> FieldType:
    if ctx.field_input(node).representation in FIELD_NONLINEARITIES:
        return _gate_function(ctx, node, ctx.field_input(node))
    t_in = require_pointwise(ctx, node)
    before = getattr(node.target, "__name__", str(node.target))
    node.target = IN_PLACE_FUNCTIONS.get(node.target) or IN_PLACE_METHODS.get(node.target)
    ctx.record(node, before, getattr(node.target, "__name__", str(node.target)))
    return t_in
