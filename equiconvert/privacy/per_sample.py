"""Per-sample gradients with augmentation multiplicity, and per-sample clipping.

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
from torch.profiler import record_function

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


def per_sample_norms(gradients: Gradients) -> torch.Tensor:
    """L2 norm of each example's whole gradient (all parameters together)."""
    squares = [g.reshape(g.shape[0], -1).pow(2).sum(1) for g in gradients.values()]
    return torch.stack(squares).sum(0).sqrt()


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Scale of each example's gradient so that its norm is at most max_grad_norm."""
    return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)


def clip_and_sum(gradients: Gradients, max_grad_norm: float) -> tuple[Gradients, torch.Tensor]:
    """Sum of per-sample gradients, each scaled to norm <= max_grad_norm; also returns the norms before clipping."""
    with record_function("equiconvert/clip_and_sum"):
        norms = per_sample_norms(gradients)
        factors = clip_factors(norms, max_grad_norm)
        summed = {name: torch.einsum("b,b...->...", factors, g) for name, g in gradients.items()}
    return summed, norms
