"""Per-sample normalisation over whole fields: no batch statistics, equivariant."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ParameterError
from . import fused_norm
from .conv import apply_to_constants


def field_groups(num_fields: int, num_groups: int) -> torch.Tensor:
    """(num_fields, num_groups) 0/1 matrix: contiguous groups of whole fields, sizes differing by at most one."""
    assignment = torch.zeros(num_fields, num_groups)
    bounds = [round(i * num_fields / num_groups) for i in range(num_groups + 1)]
    for group, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        assignment[start:stop, group] = 1.0
    return assignment


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 if it is in a lower precision: norm statistics of bf16 activations (under autocast) in fp32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _group_scale_shift(
    field_mean: torch.Tensor, field_var: torch.Tensor, to_groups: torch.Tensor, to_fields: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift), each (B, F): the per-field affine map that standardizes over groups of whole fields.

    Group statistics come from per-field ones (law of total variance: fields of a group have equal sizes),
    so the full-size tensor is read once, for the per-field moments.
    """
    group_mean = field_mean @ to_groups
    spread = (field_mean - group_mean @ to_fields).pow(2)
    group_var = (field_var + spread) @ to_groups
    scale = torch.rsqrt(group_var + eps) @ to_fields  # back to (B, F)
    shift = -(group_mean @ to_fields) * scale
    return scale, shift


def _field_group_scale_shift(
    fields: torch.Tensor, to_groups: torch.Tensor, to_fields: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    field_var, field_mean = torch.var_mean(fields, dim=-1, unbiased=False)  # (B, F)
    return _group_scale_shift(field_mean, field_var, to_groups, to_fields, eps)


def _input_grad_terms(
    grad_sum: torch.Tensor,
    grad_dot_fields: torch.Tensor,
    size: int,
    scale: torch.Tensor,
    shift: torch.Tensor,
    to_groups: torch.Tensor,
    to_fields: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slope, constant), each (B, F), with dx = scale * dy + slope * scale * x + constant.

    For y = x * scale + shift the group-norm gradient is scale * (dy - mean_g(dy) - y * mean_g(dy * y));
    the sum of dy * y per field is scale * sum(dy * x) + shift * sum(dy), so y is never formed.
    """
    grad_dot_field = grad_dot_fields * scale + grad_sum * shift
    grad_mean = (grad_sum @ to_groups) / size  # (B, G): mean of dy over each group's elements
    grad_dot = (grad_dot_field @ to_groups) / size  # mean of dy * y over each group
    slope = -(grad_dot @ to_fields) * scale
    constant = slope * shift - (grad_mean @ to_fields) * scale
    return slope, constant


def _standardization_input_grad(
    grad: torch.Tensor,
    fields: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    to_groups: torch.Tensor,
    to_fields: torch.Tensor,
) -> torch.Tensor:
    """dx of the group standardization in plain torch ops (differentiable: second derivatives use it)."""
    slope, constant = _input_grad_terms(
        grad.sum(dim=-1), (grad * fields).sum(dim=-1), fields.shape[-1], scale, shift, to_groups, to_fields
    )
    fields_grad = torch.addcmul(constant.unsqueeze(-1), grad, scale.unsqueeze(-1))
    return torch.addcmul(fields_grad, fields, (slope * scale).unsqueeze(-1))


def normalize_field_groups(
    fields: torch.Tensor, to_groups: torch.Tensor, to_fields: torch.Tensor, eps: float
) -> torch.Tensor:
    """Standardize (batch, fields, rest) per sample over groups of whole fields, in plain torch ops.

    `to_groups` (fields, groups) averages per-field values over each group, `to_fields`
    (groups, fields) hands group values back to their fields: `assignment / assignment.sum(0)`
    and `assignment.T` of a field_groups matrix. The export traces this function;
    FieldGroupNorm runs the same forward ops inside _FieldGroupStandardization, whose
    backward replaces autograd's.
    """
    scale, shift = _field_group_scale_shift(fields, to_groups, to_fields, eps)
    return torch.addcmul(shift.unsqueeze(-1), fields, scale.unsqueeze(-1))


class _FieldGroupStandardization(torch.autograd.Function):
    """normalize_field_groups with a hand-written backward: about half the memory traffic of autograd's.

    Autograd differentiates the var_mean, products and addcmul one by one (about ten passes over the
    full-size tensor); for y = (x - mean_g) * r_g with r_g = 1/sqrt(var_g + eps) the gradient is
    dx = r_g * (dy - mean_g(dy) - y * mean_g(dy * y)) (group means over all elements of the group),
    a few passes. It keeps the input, as autograd does, not the output (which a later in-place
    activation may overwrite), and never forms y again: with y = x * r_g + shift, the sum of dy * y is
    r_g sum(dy * x) + shift sum(dy) and dx is r_g dy + (slope r_g) x + a per-field constant. The forward's
    statistics are reused (or, when a graph of the backward is asked for, recomputed from the input:
    second derivatives stay exact).
    Tests compare it with autograd's in float64.
    """

    generate_vmap_rule = True  # torch.func (book-keeping's per-layer VJP, vmap per-sample gradients)

    @staticmethod
    def forward(
        fields: torch.Tensor, to_groups: torch.Tensor, to_fields: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scale, shift = _field_group_scale_shift(fields, to_groups, to_fields, eps)
        return torch.addcmul(shift.unsqueeze(-1), fields, scale.unsqueeze(-1)), scale, shift

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        fields, to_groups, to_fields, eps = inputs
        _, scale, shift = output
        ctx.eps = eps
        ctx.mark_non_differentiable(scale, shift)
        ctx.save_for_backward(fields, scale, shift, to_groups, to_fields)

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _scale_grad: torch.Tensor | None, _shift_grad: torch.Tensor | None):
        fields, scale, shift, to_groups, to_fields = ctx.saved_tensors
        if torch.is_grad_enabled():  # a graph of this backward is asked for: statistics as functions of the input
            scale, shift = _field_group_scale_shift(fields, to_groups, to_fields, ctx.eps)
        return _standardization_input_grad(grad, fields, scale, shift, to_groups, to_fields), None, None, None


class _FusedFieldGroupStandardization(torch.autograd.Function):
    """_FieldGroupStandardization on Triton kernels (fused_norm): the input read and the output written in the
    input's dtype (bf16 under autocast, never copied to fp32), statistics in fp32, one vectorized pass per step.

    The input gradient comes back in the input's dtype too. Without Triton, off CUDA and under torch.func
    FieldGroupNorm uses _FieldGroupStandardization.
    """

    @staticmethod
    def forward(
        fields: torch.Tensor, to_groups: torch.Tensor, to_fields: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = fields.reshape(-1, fields.shape[-1])
        field_mean, field_var = fused_norm.row_moments(rows)
        scale, shift = _group_scale_shift(
            field_mean.view(fields.shape[:2]), field_var.view(fields.shape[:2]), to_groups, to_fields, eps
        )
        return fused_norm.row_affine(rows, scale, shift).view(fields.shape), scale, shift

    setup_context = staticmethod(_FieldGroupStandardization.setup_context)

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _scale_grad: torch.Tensor | None, _shift_grad: torch.Tensor | None):
        fields, scale, shift, to_groups, to_fields = ctx.saved_tensors
        if torch.is_grad_enabled():  # a graph of this backward: plain torch ops, statistics from the input
            fields32 = at_least_fp32(fields)
            scale, shift = _field_group_scale_shift(fields32, to_groups, to_fields, ctx.eps)
            return (
                _standardization_input_grad(grad, fields32, scale, shift, to_groups, to_fields).to(fields.dtype),
                None,
                None,
                None,
            )
        rows, grad_rows = fields.reshape(-1, fields.shape[-1]), grad.contiguous().view(-1, fields.shape[-1])
        grad_sum, grad_dot = fused_norm.row_sums(grad_rows, rows)
        slope, constant = _input_grad_terms(
            grad_sum.view(scale.shape), grad_dot.view(scale.shape), fields.shape[-1], scale, shift, to_groups, to_fields
        )
        fields_grad = fused_norm.row_affine2(
            grad_rows, rows, scale.reshape(-1), (slope * scale).reshape(-1), constant.reshape(-1)
        )
        return fields_grad.view(fields.shape), None, None, None


class FieldGroupNorm(nn.Module):
    """GroupNorm whose groups are unions of whole fields, with affine parameters tied per field.

    Statistics are taken per sample over every channel of a group of fields and
    all positions, so they are invariant under the group and never mix samples
    (which is what makes DP-SGD legal). A constant scale and shift per field
    commutes with permutations of a regular field and with trivial fields.
    Any number of groups up to the number of fields works: when it does not
    divide the fields evenly, group sizes differ by one field.
    """

    def __init__(self, num_fields: int, field_size: int, num_groups: int, affine: bool = True, eps: float = 1e-5):
        super().__init__()
        if not 1 <= num_groups <= num_fields:
            raise ParameterError(f"num_groups={num_groups} must lie in 1..num_fields={num_fields}")
        self.num_fields, self.field_size, self.num_groups, self.eps = num_fields, field_size, num_groups, eps
        self.weight = nn.Parameter(torch.ones(num_fields)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_fields)) if affine else None
        self.assignment = field_groups(num_fields, num_groups)  # a constant, not a buffer (see SteerableConv2d)

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        apply_to_constants(self, fn, ("assignment",))
        return self

    def group_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(to_groups, to_fields): field values averaged into their groups, and group values handed back to fields."""
        return self.assignment / self.assignment.sum(0), self.assignment.T

    def _standardize(self, x: torch.Tensor) -> torch.Tensor:
        """Standardize over groups of fields, statistics in at least fp32 from x in any float dtype: on the fused
        kernels (any grouping) the output is written in x's dtype, on the torch path it is at least fp32."""
        fields = x.reshape(x.shape[0], self.num_fields, math.prod(x.shape[1:]) // self.num_fields)  # 0 samples too
        if fused_norm.fused_norm_usable(fields):
            standardization = _FusedFieldGroupStandardization
        elif self.num_fields % self.num_groups == 0:
            return F.group_norm(at_least_fp32(x), self.num_groups, None, None, self.eps)
        else:
            standardization, fields = _FieldGroupStandardization, at_least_fp32(fields)
        normalized, _, _ = standardization.apply(fields.contiguous(), *self.group_maps(), self.eps)
        return normalized.reshape(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in at least fp32 under bf16 autocast (CUDA's autocast does so for F.group_norm, CPU's does not).
        # The output keeps x's dtype: under autocast the activation, pooling and residual sums that follow move half
        # the bytes, and the next convolution, which casts its input to bf16 anyway, casts nothing.
        with torch.autocast(x.device.type, enabled=False):
            normalized = self._standardize(x)
        if self.weight is not None:
            shape = (1, -1) + (1,) * (x.ndim - 2)
            weight = self.weight.repeat_interleave(self.field_size).reshape(shape)
            bias = self.bias.repeat_interleave(self.field_size).reshape(shape)
            normalized = normalized * weight + bias
        return normalized.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"fields={self.num_fields}x{self.field_size}, num_groups={self.num_groups}, "
            f"affine={self.weight is not None}, eps={self.eps}"
        )
