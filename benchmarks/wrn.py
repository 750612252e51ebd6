"""De et al.'s WRN-16-4 (GroupNorm, no BatchNorm) in torch, and the same function in plain JAX on the torch weights.

Pre-activation wide residual blocks (GroupNorm, ReLU, 3x3 conv, twice; a 1x1 conv shortcut where the shape changes),
a 16-channel stem, stages of 16w, 32w, 64w channels at strides 1, 2, 2, then GroupNorm, ReLU, global average pool and
a linear head. De et al. standardise the conv weights; these are plain nn.Conv2d so that every engine (Opacus, fastDP,
book-keeping) runs the network unchanged. The JAX twin reads the torch parameters by name, so both compute one
function and a JAX step can be checked against a torch reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

STEM_CHANNELS = 16
NORM_GROUPS = 16


class WideBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, groups: int) -> None:
        super().__init__()
        self.stride = stride
        self.norm1 = nn.GroupNorm(min(groups, cin), cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm2 = nn.GroupNorm(min(groups, cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False) if cin != cout or stride != 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        return self.conv2(F.relu(self.norm2(self.conv1(out)))) + skip


class WideResNet(nn.Module):
    def __init__(self, depth: int = 16, width: float = 4, num_classes: int = 10, groups: int = NORM_GROUPS) -> None:
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"WideResNet depth {depth}: needs depth = 6 n + 4 (10, 16, 22, 28, ...)")
        per_stage = (depth - 4) // 6
        self.stem = nn.Conv2d(3, STEM_CHANNELS, 3, 1, 1, bias=False)
        blocks, cin = [], STEM_CHANNELS
        for stage, stride in enumerate((1, 2, 2)):
            cout = groups * max(1, round(STEM_CHANNELS * width * 2**stage / groups))  # a float width too
            for index in range(per_stage):
                blocks.append(WideBlock(cin, cout, stride if index == 0 else 1, groups))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.GroupNorm(min(groups, cin), cin)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm(self.blocks(self.stem(x))))
        return self.head(out.mean((2, 3)))


def wrn(depth: int = 16, width: int = 4, num_classes: int = 10) -> WideResNet:
    """WRN-depth-width (default De et al.'s WRN-16-4, 2.75M parameters at 10 classes)."""
    return WideResNet(depth, width, num_classes)


def jax_forward(model: WideResNet) -> Callable[[Mapping[str, Any], Any], Any]:
    """apply(params, images NCHW) -> logits: `model`'s function in jax.numpy, params named as model's parameters."""
    import jax.numpy as jnp
    from jax import lax

    def conv(x, w, stride: int, pad: int):
        return lax.conv_general_dilated(
            x, w, (stride, stride), [(pad, pad)] * 2, dimension_numbers=("NCHW", "OIHW", "NCHW")
        )

    def group_norm(x, params, prefix: str, norm: nn.GroupNorm):
        n, c, h, w = x.shape
        g = x.reshape(n, norm.num_groups, -1)
        g = (g - g.mean(-1, keepdims=True)) / jnp.sqrt(g.var(-1, keepdims=True) + norm.eps)
        scale, shift = params[f"{prefix}.weight"], params[f"{prefix}.bias"]
        return g.reshape(n, c, h, w) * scale[None, :, None, None] + shift[None, :, None, None]

    blocks = [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]

    def apply(params, x):
        out = conv(x, params["stem.weight"], 1, 1)
        for prefix, block in blocks:
            act = jnp.maximum(group_norm(out, params, f"{prefix}.norm1", block.norm1), 0)
            skip = out if block.shortcut is None else conv(act, params[f"{prefix}.shortcut.weight"], block.stride, 0)
            act = conv(act, params[f"{prefix}.conv1.weight"], block.stride, 1)
            act = jnp.maximum(group_norm(act, params, f"{prefix}.norm2", block.norm2), 0)
            out = conv(act, params[f"{prefix}.conv2.weight"], 1, 1) + skip
        out = jnp.maximum(group_norm(out, params, "norm", model.norm), 0).mean((2, 3))
        return out @ params["head.weight"].T + params["head.bias"]

    return apply
