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
from ..fields import FieldType
from ..registry import head_transparent, register_function_rule, register_module_rule

POINTWISE_REPRESENTATIONS = ("trivial", "regular")

ACTIVATION_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Hardtanh,
)
ACTIVATION_FUNCTIONS = (
    F.relu, F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish, F.hardswish,
    F.hardsigmoid, F.sigmoid, F.tanh, F.softplus, F.hardtanh, torch.relu, torch.sigmoid, torch.tanh,
    torch.selu, torch.celu,
)
ACTIVATION_METHODS = ("relu", "sigmoid", "tanh")
IN_PLACE_FUNCTIONS = {
    F.relu_: F.relu, torch.relu_: torch.relu, F.leaky_relu_: F.leaky_relu, F.elu_: F.elu,
    torch.selu_: torch.selu, torch.celu_: torch.celu, torch.sigmoid_: torch.sigmoid, torch.tanh_: torch.tanh,
}
IN_PLACE_METHODS = {"relu_": "relu", "sigmoid_": "sigmoid", "tanh_": "tanh"}


def require_pointwise(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t_in = ctx.field_input(node)
    if t_in.representation not in POINTWISE_REPRESENTATIONS:
        raise ctx.unsupported(node, f"a pointwise activation is not equivariant on {t_in.representation} fields")
    return t_in


@register_module_rule(*ACTIVATION_MODULES)
@head_transparent
def convert_activation_module(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t_in = require_pointwise(ctx, node)
    module = ctx.module(node)
    if getattr(module, "inplace", False):
        out_of_place = copy.deepcopy(module)
        out_of_place.inplace = False
        ctx.replace_module(node, out_of_place)
    return t_in


@register_module_rule(nn.PReLU)
def convert_prelu(ctx: ConversionContext, node: fx.Node) -> FieldType:
    if ctx.module(node).num_parameters != 1:
        raise ctx.unsupported(node, "PReLU with one slope per channel would differ within a field",
                              "Options: use nn.PReLU() with a single slope, or another activation.")
    return require_pointwise(ctx, node)


@register_function_rule(*ACTIVATION_FUNCTIONS, *ACTIVATION_METHODS)
@head_transparent
def convert_activation_function(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t_in = require_pointwise(ctx, node)
    if node.kwargs.get("inplace"):
        node.kwargs = {**node.kwargs, "inplace": False}
    return t_in


@register_function_rule(*IN_PLACE_FUNCTIONS, *IN_PLACE_METHODS)
@head_transparent
def convert_in_place_activation(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t_in = require_pointwise(ctx, node)
    before = getattr(node.target, "__name__", str(node.target))
    node.target = IN_PLACE_FUNCTIONS.get(node.target) or IN_PLACE_METHODS.get(node.target)
    ctx.record(node, before, getattr(node.target, "__name__", str(node.target)))
    return t_in


