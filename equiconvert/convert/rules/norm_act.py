"""timm's fused norm + activation layers, layer norms over channels and layer scale.

A norm-act layer becomes its per-sample field norm (FieldGroupNorm, as BatchNorm2d and
GroupNorm do) followed by its dropout and its activation, converted like standalone ones.
A layer norm over the channels of each pixel becomes FieldLayerNorm; a learned per-channel
gain (layer scale) becomes FieldLayerScale, one gain per field.
"""

from __future__ import annotations

import copy

import torch.fx as fx
from torch import nn

from ...nn.layer_norm import FieldLayerNorm
from ...nn.layer_scale import FieldLayerScale
from ..context import ConversionContext
from ..fields import FieldType
from ..registry import head_transparent, module_rule, register_module_rule
from .activation import (
    FIELD_NONLINEARITIES,
    POINTWISE_REPRESENTATIONS,
    out_of_place,
    convert_activation_module,
)
from .norm import field_norm


def optional_classes(module: str, *names: str) -> list[str]:
    """ "module:Name" for classes of optional packages (timm, torchvision): registered once a model imports them."""
    return [f"{module}:{name}" for name in names]


TIMM_ACTIVATIONS = optional_classes(
    "timm.layers.activations",
    "Swish",
    "Mish",
    "Sigmoid",
    "Tanh",
    "HardSwish",
    "HardSigmoid",
    "HardMish",
    "GELU",
    "GELUTanh",
    "QuickGELU",
)
PASSIVE_DROPS = (nn.Identity, nn.Dropout, nn.Dropout2d)
BATCH_NORM_ACT = optional_classes("timm.layers.norm_act", "BatchNormAct2d", "SyncBatchNormAct", "FrozenBatchNormAct2d")
FROZEN_BATCH_NORM = optional_classes("timm.layers", "FrozenBatchNorm2d") + optional_classes(
    "torchvision.ops.misc", "FrozenBatchNorm2d"
)
GROUP_NORM_ACT = optional_classes("timm.layers.norm_act", "GroupNormAct", "GroupNorm1Act")
LAYER_NORM_ACT_2D = optional_classes("timm.layers.norm_act", "LayerNormAct2d", "LayerNormAct2dFp32")
LAYER_NORM_2D = optional_classes("timm.layers.norm", "LayerNorm2d", "LayerNorm2dFp32") + optional_classes(
    "torchvision.models.convnext", "LayerNorm2d"
)
LAYER_NORM_LAST = (
    [nn.LayerNorm]
    + optional_classes("timm.layers.norm", "LayerNorm", "LayerNormFp32")
    + optional_classes("timm.layers.norm_act", "LayerNormAct", "LayerNormActFp32")
)
LAYER_SCALE = optional_classes("timm.layers.layer_scale", "LayerScale", "LayerScale2d") + optional_classes(
    "timm.models.convnext", "LayerScale2d"
)

register_module_rule(*TIMM_ACTIVATIONS)(convert_activation_module)  # elementwise, like torch's own


def norm_activation(ctx: ConversionContext, node: fx.Node, act: nn.Module, t: FieldType) -> nn.Module:
    """The equivariant form of a norm-act layer's activation on fields of type `t`."""
    if isinstance(act, nn.Identity):
        return act
    if module_rule(type(act)) is not convert_activation_module:
        raise ctx.unsupported(
            node,
            f"its activation {type(act).__name__} has no equivariant form",
            "Options: use an elementwise activation (ReLU, SiLU, GELU, ...) in the norm layer.",
        )
    if t.representation in FIELD_NONLINEARITIES:
        return FIELD_NONLINEARITIES[t.representation](t, out_of_place(act))
    if t.representation not in POINTWISE_REPRESENTATIONS:
        raise ctx.unsupported(node, f"a pointwise activation is not equivariant on {t.representation} fields")
    return out_of_place(copy.deepcopy(act))


def _drop(ctx: ConversionContext, node: fx.Node, drop: nn.Module) -> nn.Module:
    if not isinstance(drop, PASSIVE_DROPS):
        raise ctx.unsupported(
            node,
            f"its drop layer {type(drop).__name__} drops spatial blocks, which rotations move",
            "Options: build the model without drop_block_rate before converting.",
        )
    return copy.deepcopy(drop)


def check_norm_channels(ctx: ConversionContext, node: fx.Node, channels: int, t: FieldType) -> None:
    """Refuse a norm whose channel count differs from its input's, wherever its layout puts the channels."""
    shape = ctx.shape(node.args[0])
    seen = shape[-1] if t.channels_last or not t.spatial and len(shape) == 2 else shape[1]
    if seen != channels:
        raise ctx.unsupported(node, f"normalises {channels} channels but its input has {seen}")


def _replace_norm_act(ctx: ConversionContext, node: fx.Node, norm: nn.Module, t: FieldType) -> FieldType:
    module = ctx.module(node)
    ctx.replace_module(
        node, nn.Sequential(norm, _drop(ctx, node, module.drop), norm_activation(ctx, node, module.act, t))
    )
    return t


@register_module_rule(*BATCH_NORM_ACT, *FROZEN_BATCH_NORM)
def convert_batch_norm_act(ctx: ConversionContext, node: fx.Node) -> FieldType:
    module, t = ctx.module(node), ctx.field_input(node)
    channels = module.num_features if hasattr(module, "num_features") else module.weight.numel()
    check_norm_channels(ctx, node, channels, t)
    norm = field_norm(t, min(t.num_fields, ctx.config.batchnorm_groups), True, module.eps)
    if not hasattr(module, "act"):  # a plain frozen batch norm
        ctx.replace_module(node, norm)
        return t
    return _replace_norm_act(ctx, node, norm, t)


@register_module_rule(*GROUP_NORM_ACT)
def convert_group_norm_act(ctx: ConversionContext, node: fx.Node) -> FieldType:
    module, t = ctx.module(node), ctx.field_input(node)
    check_norm_channels(ctx, node, module.num_channels, t)
    norm = field_norm(t, min(t.num_fields, module.num_groups), module.affine, module.eps)
    return _replace_norm_act(ctx, node, norm, t)


def _layer_norm(ctx: ConversionContext, node: fx.Node, t: FieldType, channels_last: bool) -> FieldLayerNorm:
    module = ctx.module(node)
    if len(module.normalized_shape) != 1:
        raise ctx.unsupported(
            node, f"normalises over {tuple(module.normalized_shape)}; only the channel dim is supported"
        )
    check_norm_channels(ctx, node, module.normalized_shape[0], t)
    if t.representation not in POINTWISE_REPRESENTATIONS:
        raise ctx.unsupported(node, f"a layer norm's mean is not equivariant on {t.representation} fields")
    affine = module.weight is not None
    return FieldLayerNorm(t.num_fields, t.field_size, affine, module.eps, channels_last)


@register_module_rule(*LAYER_NORM_2D, *LAYER_NORM_ACT_2D)
@head_transparent
def convert_layer_norm_2d(ctx: ConversionContext, node: fx.Node) -> FieldType:
    t = ctx.field_input(node)
    if t.channels_last or not t.spatial:
        raise ctx.unsupported(node, "a channels-first layer norm receives a channels-last or flattened tensor")
    norm = _layer_norm(ctx, node, t, channels_last=False)
    if hasattr(ctx.module(node), "act"):
        return _replace_norm_act(ctx, node, norm, t)
    ctx.replace_module(node, norm)
    return t


@register_module_rule(*LAYER_NORM_LAST)
@head_transparent
def convert_layer_norm_last(ctx: ConversionContext, node: fx.Node) -> FieldType:
    """nn.LayerNorm over the last dim: on channels-last maps or (batch, features) vectors."""
    t = ctx.field_input(node)
    if t.spatial and not t.channels_last:
        raise ctx.unsupported(
            node,
            "normalises the last dim of a channels-first map (its width, not its channels)",
            "Options: permute to channels-last first, or use a LayerNorm2d.",
        )
    if t.is_invariant and not t.spatial:  # invariant features: any layer norm keeps them invariant
        return t
    norm = _layer_norm(ctx, node, t, channels_last=True)
    if hasattr(ctx.module(node), "act"):
        return _replace_norm_act(ctx, node, norm, t)
    ctx.replace_module(node, norm)
    return t


def layer_scale_module(t: FieldType, gamma) -> FieldLayerScale:
    """FieldLayerScale starting from the mean of the original per-channel gains."""
    return FieldLayerScale(t.num_fields, t.field_size, float(gamma.detach().float().mean()), t.channels_last)


@register_module_rule(*LAYER_SCALE)
def convert_layer_scale(ctx: ConversionContext, node: fx.Node) -> FieldType:
    module, t = ctx.module(node), ctx.field_input(node)
    if getattr(module, "inplace", False):
        module.inplace = False
    check_norm_channels(ctx, node, module.gamma.numel(), t)
    ctx.replace_module(node, layer_scale_module(t, module.gamma))
    return t
