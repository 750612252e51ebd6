"""ResNet9 of Klause et al. (2022), "Differentially private training of residual
networks with scale normalisation".

This is the plain (non-equivariant) baseline that equiconvert converts into a
steerable CNN. It is built only from standard ``nn`` modules with named
submodules and a straight-line ``forward`` so that ``torch.fx.symbolic_trace``
(and hence the converter) can walk it.

Configuration that reproduces the paper's parameter counts exactly
(10 classes, widths (64, 128, 256)): bias-free 3x3 convs, affine norm layers
(GroupNorm with ``min(32, C)`` groups), Linear with bias:
2,447,946 parameters without ScaleNorm, 2,448,714 with it.
"""

from __future__ import annotations

from numbers import Integral
from typing import Callable, ClassVar, Sequence, Union

import torch
from torch import nn

from ..errors import ParameterError
from ._registry import ModelNameError, register_model

__all__ = ["ResNet9", "resnet9", "make_norm", "NORMS", "ACTIVATIONS", "activation_class", "check_widths"]

NORMS: tuple[str, ...] = ("group", "batch", "instance", "none")
HEAD_POOLS = {"max": nn.AdaptiveMaxPool2d, "avg": nn.AdaptiveAvgPool2d}


BLOCK_ORDERS: tuple[str, ...] = ("conv-norm-act", "conv-act-norm")

# Activations by name, so a config file or --model-kwargs act=gelu can choose one.
ACTIVATIONS: dict[str, type[nn.Module]] = {
    "mish": nn.Mish,
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "elu": nn.ELU,
    "selu": nn.SELU,
    "tanh": nn.Tanh,
    "leaky_relu": nn.LeakyReLU,
}
ActivationSpec = Union[str, Callable[[], nn.Module]]


def activation_class(act: ActivationSpec) -> Callable[[], nn.Module]:
    """The activation factory for `act`: a module class (or other zero-argument callable) or an ACTIVATIONS name."""
    if isinstance(act, str):
        if act.lower() not in ACTIVATIONS:
            raise ModelNameError(f"act {act!r} is not an activation name; use one of {', '.join(sorted(ACTIVATIONS))}")
        return ACTIVATIONS[act.lower()]
    if not callable(act):
        raise ModelNameError(
            f"act {act!r} is neither a module class nor an activation name; use one of "
            f"{', '.join(sorted(ACTIVATIONS))}, or an nn.Module class such as nn.ReLU"
        )
    return act


def check_widths(widths: Sequence[int]) -> tuple[int, int, int]:
    """The three stage widths, each an int >= 1 (a zero or negative width fails deep inside torch otherwise)."""
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or len(widths) != 3:
        raise ParameterError(f"widths must have 3 entries, got {widths!r}")
    if any(isinstance(w, bool) or not isinstance(w, Integral) or w < 1 for w in widths):
        raise ParameterError(
            f"widths must be 3 ints >= 1 (channels per stage), got {tuple(widths)!r}; e.g. widths=(16, 32, 64)"
        )
    w0, w1, w2 = (int(w) for w in widths)
    return w0, w1, w2


def make_norm(norm: str, channels: int, affine: bool = True, groups: int | None = None) -> nn.Module:
    """Build the normalisation layer for ``channels`` channels.

    GroupNorm is the default because BatchNorm mixes samples and is therefore
    incompatible with per-sample gradient clipping in DP-SGD. ``groups`` defaults
    to ``min(32, channels)``.
    """
    if norm == "group":
        return nn.GroupNorm(num_groups=min(groups or 32, channels), num_channels=channels, affine=affine)
    if norm == "batch":
        return nn.BatchNorm2d(channels, affine=affine)
    if norm == "instance":
        return nn.InstanceNorm2d(channels, affine=affine)
    if norm == "none":
        return nn.Identity()
    raise ParameterError(f"unknown norm {norm!r}; allowed values are {', '.join(map(repr, NORMS))}")


def conv_block(
    in_channels: int,
    out_channels: int,
    norm: str,
    act: Callable[[], nn.Module],
    pool: bool = False,
    options: "BlockOptions | None" = None,
) -> nn.Sequential:
    """conv3x3 -> norm -> act (-> maxpool 2), or conv -> act -> norm with ``block_order="conv-act-norm"``.

    By default the conv has no bias because the following (affine) norm layer makes it
    redundant; this is what gives the paper's exact parameter count.
    """
    options = options or BlockOptions()
    conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=options.conv_bias)
    norm_layer = make_norm(norm, out_channels, options.norm_affine, options.norm_groups)
    if options.block_order == "conv-act-norm":  # Hölzl et al.: the norm sees activated features
        layers: list[nn.Module] = [conv, act(), norm_layer]
    else:
        layers = [conv, norm_layer, act()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class BlockOptions:
    """Per-block choices beyond Klause et al.'s defaults (used by the equivariant preset)."""

    def __init__(
        self,
        block_order: str = "conv-norm-act",
        conv_bias: bool = False,
        norm_affine: bool = True,
        norm_groups: int | None = None,
    ) -> None:
        if block_order not in BLOCK_ORDERS:
            raise ParameterError(
                f"unknown block_order {block_order!r}; allowed values are {', '.join(map(repr, BLOCK_ORDERS))}"
            )
        self.block_order, self.conv_bias = block_order, conv_bias
        self.norm_affine, self.norm_groups = norm_affine, norm_groups


class Residual(nn.Module):
    """Residual block ``x + body(x)`` with optional ScaleNorm.

    ScaleNorm (Klause et al.) puts an extra norm after the addition,
    ``norm(x + body(x))``, to keep activation scale under control when
    training with DP-SGD.
    """

    def __init__(
        self,
        channels: int,
        norm: str,
        act: Callable[[], nn.Module],
        scale_norm: bool,
        options: BlockOptions | None = None,
    ) -> None:
        super().__init__()
        options = options or BlockOptions()
        self.body = nn.Sequential(
            conv_block(channels, channels, norm, act, options=options),
            conv_block(channels, channels, norm, act, options=options),
        )
        # Identity keeps the module structure (and forward) unconditional.
        self.scale_norm: nn.Module = (
            make_norm(norm, channels, options.norm_affine, options.norm_groups) if scale_norm else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale_norm(x + self.body(x))


class ResNet9(nn.Module):
    """ResNet9: stem, layer1, res1, layer2, layer3, res2 (optional), head.

    Stage names are stable so the converter and tests can address them.
    """

    # make_equivariant's head when none is asked for: the 2x2 grid the head flattens is permuted by rotations, so
    # only group pooling before it gives an invariant classifier (convert.core.default_head)
    equiconvert_head: ClassVar[str] = "invariant"

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        widths: Sequence[int] = (64, 128, 256),
        norm: str = "group",
        scale_norm: bool = True,
        act: ActivationSpec = nn.Mish,
        options: BlockOptions | None = None,
        head_pool: str = "max",
        res2: bool = True,
        pool_after_res2: bool = False,
    ) -> None:
        super().__init__()
        if norm not in NORMS:
            raise ParameterError(f"unknown norm {norm!r}; allowed values are {', '.join(map(repr, NORMS))}")
        w0, w1, w2 = check_widths(widths)
        act = activation_class(act)
        if head_pool not in HEAD_POOLS:
            raise ParameterError(
                f"unknown head_pool {head_pool!r}; allowed values are {', '.join(map(repr, HEAD_POOLS))}"
            )
        self.stem = conv_block(in_channels, w0, norm, act, options=options)
        self.layer1 = conv_block(w0, w1, norm, act, pool=True, options=options)
        self.res1 = Residual(w1, norm, act, scale_norm, options)
        self.layer2 = conv_block(w1, w2, norm, act, pool=True, options=options)
        self.layer3 = conv_block(w2, w2, norm, act, pool=not pool_after_res2, options=options)
        # res2=False: identity in its place (the forward, and so the traced graph's node names, stay the same); it
        # holds about half the parameters of the paper's layout, and DP-SGD's noise grows with the parameter count
        self.res2: nn.Module = Residual(w2, norm, act, scale_norm, options) if res2 else nn.Identity()
        if pool_after_res2:  # res2 at twice the resolution (8x8 for 32x32 inputs): more FLOPs, the same parameters
            self.res2 = nn.Sequential(self.res2, nn.MaxPool2d(2))
        # Adaptive pooling to 2x2 makes the head independent of input size
        # (e.g. 32x32 CIFAR and 28x28 MNIST).
        self.head = nn.Sequential(
            HEAD_POOLS[head_pool](2),
            nn.Flatten(),
            nn.Linear(w2 * 2 * 2, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer1(x)
        x = self.res1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.res2(x)
        return self.head(x)


@register_model
def resnet9(
    num_classes: int = 10,
    in_channels: int = 3,
    widths: Sequence[int] = (64, 128, 256),
    norm: str = "group",
    scale_norm: bool = True,
    act: ActivationSpec = nn.Mish,
) -> nn.Module:
    """Build the Klause et al. ResNet9 (see module docstring for the exact config).

    act: a module class or an ACTIVATIONS name ("relu", "gelu", ...)."""
    return ResNet9(
        num_classes=num_classes,
        in_channels=in_channels,
        widths=widths,
        norm=norm,
        scale_norm=scale_norm,
        act=act,
    )
