"""The DP-SGD mechanism, once: drop non-finite examples, clip, sum, add Gaussian noise once, divide.

DPTrainer and make_private's DPOptimizer are front-ends that compute per-example gradients
and call these functions; the data-parallel path passes its all-reduce to `privatize`. Each
example's whole gradient (all parameters together) is scaled to norm <= C by
min(1, C / (norm + 1e-6)) (Opacus' factor), so one example moves the sum by at most C;
the sum then gets N(0, (sigma C)^2) per coordinate from the secret noise source. Nothing
here waits for the device: counts and sums stay device tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, MutableMapping, Sequence
from typing import TypeVar

import torch
from torch.profiler import record_function

from .nonfinite import zero_nonfinite_examples
from .secure_rng import RandomSource

Key = TypeVar("Key", bound=Hashable)  # a parameter name (DPTrainer) or the parameter itself (DPOptimizer)
AllReduce = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]  # element-wise sums over the ranks of a job

CLIP_EPS = 1e-6  # added to the norm in the clip factor's denominator (as Opacus does)


def per_sample_norms(gradients: Mapping[Key, torch.Tensor]) -> torch.Tensor:
    """L2 norm of each example's whole gradient (all parameters together): {key: (B, *shape)} -> (B,)."""
    squares = [g.reshape(g.shape[0], -1).pow(2).sum(1) for g in gradients.values()]
    return torch.stack(squares).sum(0).sqrt()


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """Scale of each example's gradient so that its norm is at most max_grad_norm."""
    return (max_grad_norm / (norms + CLIP_EPS)).clamp(max=1.0)


def clip_and_sum(
    gradients: Mapping[Key, torch.Tensor], max_grad_norm: float
) -> tuple[dict[Key, torch.Tensor], torch.Tensor]:
    """Sum of per-sample gradients, each scaled to norm <= max_grad_norm; also returns the norms before clipping.

    One matrix-vector product per parameter (4 operators to dispatch; einsum takes 13): a DP step that waits on
    the host gets shorter with every operator it does not launch.
    """
    with record_function("equiconvert/clip_and_sum"):
        norms = per_sample_norms(gradients)
        factors = clip_factors(norms, max_grad_norm)
        summed = {key: _weighted_sum(g, factors.to(g.dtype)) for key, g in gradients.items()}
    return summed, norms


def _weighted_sum(per_example: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_b weights[b] * per_example[b]; also for no examples and for scalar parameters."""
    rows = per_example.reshape(per_example.shape[0], math.prod(per_example.shape[1:]))
    return torch.mv(rows.T, weights).view(per_example.shape[1:])


def clip_and_accumulate(
    per_example_grads: Mapping[Key, torch.Tensor],
    max_grad_norm: float,
    into: MutableMapping[Key, torch.Tensor],
    real: torch.Tensor | None = None,
) -> torch.Tensor | int:
    """Add the clipped sum of one physical batch's per-example gradients to `into` (updated in place).

    An example with any non-finite entry counts as zero (nonfinite.py); returns how many did, as a device tensor
    (0 for an empty batch). `real` (B,): False on blank padding rows, which add zero and are not counted.
    """
    if not per_example_grads:
        return 0
    grads, nonfinite = zero_nonfinite_examples(per_example_grads, real)
    clipped, _ = clip_and_sum(grads, max_grad_norm)
    add_into(into, clipped)
    return nonfinite


def add_into(into: MutableMapping[Key, torch.Tensor], values: Mapping[Key, torch.Tensor]) -> None:
    """into[key] += value for every entry of `values` (in place; a key not yet in `into` takes the value)."""
    for key, value in values.items():
        into[key] = into[key].add_(value) if key in into else value


def privatize(
    summed: Mapping[Key, torch.Tensor],
    noise_multiplier: float,
    max_grad_norm: float,
    source: RandomSource,
    divisor: float,
    add_noise: bool = True,
    all_reduce: AllReduce | None = None,
) -> dict[Key, torch.Tensor]:
    """(sum + N(0, (noise_multiplier * max_grad_norm)^2), summed over ranks) / divisor, per tensor of `summed`.

    `summed` holds one clipped sum for every trainable parameter (zeros where no example contributed), in a fixed
    order: the noise is drawn from `source` in that order. In a data-parallel job only the rank with
    `add_noise` draws it, so the noise enters the job's sum once; `all_reduce` sums over the ranks before the
    division (None: one process).
    """
    std = noise_multiplier * max_grad_norm
    if add_noise:
        summed = {
            key: value + source.gaussian(value.shape, std, dtype=value.dtype).to(value.device)
            for key, value in summed.items()
        }
    keys, values = list(summed), list(summed.values())
    if all_reduce is not None:
        values = all_reduce(values)
    return {key: value / divisor for key, value in zip(keys, values)}
