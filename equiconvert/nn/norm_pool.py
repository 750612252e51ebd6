"""An affine-free FieldGroupNorm and the window max pool after it, as one layer that pools first.

Standardizing a group of fields maps x to x * scale + shift with scale > 0 per (sample, field): an
increasing map, so it commutes with a max over each window, and pool(norm(x)) is the pooled x
standardized with the full-size x's statistics. The layer never writes the full-size normalized
tensor: its forward reads x for the moments and for the pool and writes the pooled output; its
backward forms the group sums from pooled tensors (the pool's gradient is zero off the window
maxima) and writes the input gradient once, then the maxima's exact values over it. Outputs equal
norm-then-pool up to the statistics' rounding; a window whose maxima tie after rounding may route its
gradient to another of them. Conversion fuses the pair (convert/fuse.py); export splits it again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ..errors import ParameterError
from . import fused_norm
from .norm import FieldGroupNorm, _group_scale_shift, _input_grad_terms, at_least_fp32
from .window_pool import window_max_pool2d


def _moments(rows: torch.Tensor, kernels: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, biased variance) per row, in at least fp32."""
    if kernels:
        return fused_norm.row_moments(rows)
    var, mean = torch.var_mean(at_least_fp32(rows), dim=-1, unbiased=False)
    return mean, var


def _affine(rows: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, kernels: bool) -> torch.Tensor:
    """rows * scale + shift per row, computed in at least fp32 and returned in the dtype of rows."""
    if kernels:
        return fused_norm.row_affine(rows, scale, shift)
    return torch.addcmul(shift.unsqueeze(-1), at_least_fp32(rows), scale.unsqueeze(-1)).to(rows.dtype)


def _affine2(
    grad: torch.Tensor,
    rows: torch.Tensor,
    grad_scale: torch.Tensor,
    rows_scale: torch.Tensor,
    shift: torch.Tensor,
    kernels: bool,
) -> torch.Tensor:
    """grad * grad_scale + rows * rows_scale + shift per row, in the dtype of rows."""
    if kernels:
        return fused_norm.row_affine2(grad, rows, grad_scale, rows_scale, shift)
    wide = torch.addcmul(shift.unsqueeze(-1), at_least_fp32(grad), grad_scale.unsqueeze(-1))
    return torch.addcmul(wide, at_least_fp32(rows), rows_scale.unsqueeze(-1)).to(rows.dtype)


class _PooledStandardization(torch.autograd.Function):
    @staticmethod
    def forward(
        x: torch.Tensor, kernel: int, num_fields: int, to_groups: torch.Tensor, to_fields: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, ...]:
        kernels = fused_norm.fused_norm_usable(x)
        rows = x.reshape(x.shape[0] * num_fields, -1)
        mean, var = _moments(rows, kernels)
        scale, shift = _group_scale_shift(
            mean.view(x.shape[0], num_fields), var.view(x.shape[0], num_fields), to_groups, to_fields, eps
        )
        pooled, indices = F.max_pool2d(x, kernel, kernel, return_indices=True)
        out = _affine(pooled.reshape(rows.shape[0], -1), scale.reshape(-1), shift.reshape(-1), kernels)
        return out.view(pooled.shape), indices, pooled, scale, shift

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, _kernel, _num_fields, to_groups, to_fields, _eps = inputs
        _, indices, pooled, scale, shift = output
        ctx.mark_non_differentiable(indices, pooled, scale, shift)
        ctx.save_for_backward(x, indices, pooled, scale, shift, to_groups, to_fields)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor, *_unused: torch.Tensor | None):
        x, indices, pooled, scale, shift, to_groups, to_fields = ctx.saved_tensors
        kernels = fused_norm.fused_norm_usable(x)
        rows = x.reshape(scale.numel(), -1)
        grad_rows, pooled_rows = grad.contiguous().view(scale.numel(), -1), pooled.reshape(scale.numel(), -1)
        if kernels:
            grad_sum, grad_dot = fused_norm.row_sums(grad_rows, pooled_rows)
        else:
            wide_grad = at_least_fp32(grad_rows)
            grad_sum, grad_dot = wide_grad.sum(-1), (wide_grad * at_least_fp32(pooled_rows)).sum(-1)
        # off the window maxima the norm's output gradient is zero: its sums over x are the pooled sums
        slope, constant = _input_grad_terms(
            grad_sum.view(scale.shape), grad_dot.view(scale.shape), rows.shape[1], scale, shift, to_groups, to_fields
        )
        x_scale, constant = (slope * scale).reshape(-1), constant.reshape(-1)
        x_grad = _affine(rows, x_scale, constant, kernels)  # everywhere but the maxima: no output gradient
        at_maxima = _affine2(grad_rows, pooled_rows, scale.reshape(-1), x_scale, constant, kernels)
        x_grad.view(*x.shape[:2], -1).scatter_(-1, indices.flatten(-2), at_maxima.view(*x.shape[:2], -1))
        return x_grad.view(x.shape), None, None, None, None, None


class FieldGroupNormMaxPool2d(nn.Module):
    """`norm` (a FieldGroupNorm without affine parameters) followed by a max pool over kernel x kernel windows
    with stride kernel, computed pool-first (see the module docstring); under torch.func transforms (vmap
    per-sample gradients) the two layers run one after the other."""

    def __init__(self, norm: FieldGroupNorm, kernel_size: int) -> None:
        super().__init__()
        if norm.weight is not None:
            raise ParameterError(
                f"FieldGroupNormMaxPool2d needs a FieldGroupNorm without affine parameters ({norm.extra_repr()}): "
                "a negative weight would not commute with the max"
            )
        self.norm, self.kernel_size = norm, kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch._C._functorch.is_functorch_wrapped_tensor(x):
            return window_max_pool2d(self.norm(x), self.kernel_size)
        norm = self.norm
        with torch.autocast(x.device.type, enabled=False):  # statistics in at least fp32, output in x's dtype
            out, *_ = _PooledStandardization.apply(
                x.contiguous(), self.kernel_size, norm.num_fields, *norm.group_maps(), norm.eps
            )
        return out

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}"
