"""Per-sample gradients with augmentation multiplicity (clipping: dp_step.py).

torch.func computes the gradient of each example's loss in one vectorised pass:
`vmap(grad(loss))` over examples, each example being its K augmented views, so
the per-sample gradient is the average over views before clipping (De et al.,
Hölzl et al.). Parameters of steerable convs are basis coefficients, so the
clipping norm is the norm in coefficient space, as DP-SGD requires.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

Gradients = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def per_sample_gradients(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    views: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: LossFn = F.cross_entropy,
) -> tuple[Gradients, torch.Tensor]:
    """Each example's gradient of its mean loss over its K views, and that loss.

    views (B, K, C, H, W) -> ({name: (B, *shape)}, (B,)).
    """

    def example_loss(p: dict[str, torch.Tensor], example_views: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (p, buffers), (example_views,))
        return loss_fn(logits, label.expand(example_views.shape[0]))

    return vmap(grad_and_value(example_loss), in_dims=(None, 0, 0), randomness="different")(params, views, labels)
