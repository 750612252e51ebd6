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

from typing import Sequence

import torch
from torch import nn

__all__ = ["ResNet9", "resnet9", "make_norm", "NORMS"]

NORMS: tuple[str, ...] = ("group", "batch", "instance", "none")


def make_norm(norm: str, channels: int) -> nn.Module:
    """Build the normalisation layer for ``channels`` channels.

    GroupNorm is the default because BatchNorm mixes samples and is therefore
    incompatible with per-sample gradient clipping in DP-SGD.
    """
    if norm == "group":
        return nn.GroupNorm(num_groups=min(32, channels), num_channels=channels)
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    if norm == "instance":
        return nn.InstanceNorm2d(channels, affine=True)
    if norm == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {norm!r}; allowed values are {', '.join(map(repr, NORMS))}")


def conv_block(
    in_channels: int,
    out_channels: int,
    norm: str,
    act: type[nn.Module],
    pool: bool = False,
) -> nn.Sequential:
    """conv3x3 -> norm -> act (-> maxpool 2).

    The conv has no bias because the following (affine) norm layer makes it
    redundant; this is what gives the paper's exact parameter count.
    """
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
        make_norm(norm, out_channels),
        act(),
    ]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


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
        act: type[nn.Module],
        scale_norm: bool,
    ) -> None:
        super().__init__()
        self.body = nn.Sequential(
            conv_block(channels, channels, norm, act),
            conv_block(channels, channels, norm, act),
        )
        # Identity keeps the module structure (and forward) unconditional.
        self.scale_norm: nn.Module = make_norm(norm, channels) if scale_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale_norm(x + self.body(x))


class ResNet9(nn.Module):
    """ResNet9: stem, layer1, res1, layer2, layer3, res2, head.

    Stage names are stable so the converter and tests can address them.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        widths: Sequence[int] = (64, 128, 256),
        norm: str = "group",
        scale_norm: bool = True,
        act: type[nn.Module] = nn.Mish,
    ) -> None:
        super().__init__()
        if norm not in NORMS:
            raise ValueError(
                f"unknown norm {norm!r}; allowed values are {', '.join(map(repr, NORMS))}"
            )
        if len(widths) != 3:
            raise ValueError(f"widths must have 3 entries, got {tuple(widths)!r}")
        w0, w1, w2 = (int(w) for w in widths)
        self.stem = conv_block(in_channels, w0, norm, act)
        self.layer1 = conv_block(w0, w1, norm, act, pool=True)
        self.res1 = Residual(w1, norm, act, scale_norm)
        self.layer2 = conv_block(w1, w2, norm, act, pool=True)
        self.layer3 = conv_block(w2, w2, norm, act, pool=True)
        self.res2 = Residual(w2, norm, act, scale_norm)
        # Adaptive pooling to 2x2 makes the head independent of input size
        # (e.g. 32x32 CIFAR and 28x28 MNIST).
        self.head = nn.Sequential(
            nn.AdaptiveMaxPool2d(2),
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


def resnet9(
    num_classes: int = 10,
    in_channels: int = 3,
    widths: Sequence[int] = (64, 128, 256),
    norm: str = "group",
    scale_norm: bool = True,
    act: type[nn.Module] = nn.Mish,
) -> nn.Module:
    """Build the Klause et al. ResNet9 (see module docstring for the exact config)."""
    return ResNet9(
        num_classes=num_classes,
        in_channels=in_channels,
        widths=widths,
        norm=norm,
        scale_norm=scale_norm,
        act=act,
    )
