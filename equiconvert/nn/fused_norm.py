"""Triton kernels for the uneven field group norm on CUDA: fewer, vectorized passes over the activations.

PyTorch runs the norm's per-(sample, field) affine maps as broadcast addcmuls, which its
TensorIterator cannot vectorize, and under bf16 autocast it first copies the activations to fp32.
These kernels read and write the activations in their own dtype, accumulate in fp32, and make one
pass for the statistics, one for the output, and two for the backward (sums, then the input gradient).
Rows are (sample, field) pairs of a contiguous (rows, length) view. Without Triton, off CUDA, or
under torch.func transforms FieldGroupNorm keeps its plain-torch path. The tests run these kernels
on CPU tensors in Triton's interpreter.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton ships with PyTorch's CUDA wheels on Linux; elsewhere the torch path runs
    triton = None

_KERNEL_DEVICES = ("cuda",)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # float64 keeps the torch path's precision
_MAX_BLOCK = 2048  # elements a program reads per iteration of a row loop
_ELEMENTWISE_BLOCK = 1024


def fused_norm_usable(x: torch.Tensor) -> bool:
    """Whether the kernels can run on x: Triton present, a CUDA tensor of 16 or 32 bits, no torch.func wrapper."""
    if triton is None or x.device.type not in _KERNEL_DEVICES or x.dtype not in _KERNEL_DTYPES:
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(x)


if triton is not None:

    @triton.jit
    def _row_moments_kernel(x_ptr, mean_ptr, var_ptr, length, BLOCK: tl.constexpr):
        """Mean and (biased) variance of each row, block moments merged by Chan's formula (no cancellation)."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * length
        count = tl.zeros((1,), tl.float32)
        mean = tl.zeros((1,), tl.float32)
        squares = tl.zeros((1,), tl.float32)
        for start in range(0, length, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            inside = offsets < length
            values = tl.load(base + offsets, mask=inside, other=0.0).to(tl.float32)
            block_count = tl.minimum(length - start, BLOCK).to(tl.float32)
            block_mean = tl.sum(values, axis=0) / block_count
            deviations = tl.where(inside, values - block_mean, 0.0)
            block_squares = tl.sum(deviations * deviations, axis=0)
            total = count + block_count
            delta = block_mean - mean
            mean += delta * (block_count / total)
            squares += block_squares + delta * delta * (count * block_count / total)
            count = total
        first = tl.arange(0, 1)
        tl.store(mean_ptr + row + first, mean)
        tl.store(var_ptr + row + first, squares / count)

    @triton.jit
    def _row_sums_kernel(grad_ptr, x_ptr, grad_sum_ptr, grad_dot_ptr, length, BLOCK: tl.constexpr):
        """Per row: the sum of grad and the sum of grad * x, in fp32."""
        row = tl.program_id(0).to(tl.int64)
        grad_total = tl.zeros((BLOCK,), tl.float32)
        dot_total = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, length, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            inside = offsets < length
            grad = tl.load(grad_ptr + row * length + offsets, mask=inside, other=0.0).to(tl.float32)
            values = tl.load(x_ptr + row * length + offsets, mask=inside, other=0.0).to(tl.float32)
            grad_total += grad
            dot_total += grad * values
        tl.store(grad_sum_ptr + row, tl.sum(grad_total, axis=0))
        tl.store(grad_dot_ptr + row, tl.sum(dot_total, axis=0))

    @triton.jit
    def _row_affine_kernel(x_ptr, scale_ptr, shift_ptr, out_ptr, numel, length, BLOCK: tl.constexpr):
        """out = x * scale[row] + shift[row] over the flat tensor."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        rows = offsets // length
        values = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + rows, mask=inside, other=0.0)
        shift = tl.load(shift_ptr + rows, mask=inside, other=0.0)
        tl.store(out_ptr + offsets, (values * scale + shift).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _row_affine2_kernel(
        grad_ptr, x_ptr, grad_scale_ptr, x_scale_ptr, shift_ptr, out_ptr, numel, length, BLOCK: tl.constexpr
    ):
        """out = grad * grad_scale[row] + x * x_scale[row] + shift[row] over the flat tensors."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < numel
        rows = offsets // length
        grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        values = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        grad_scale = tl.load(grad_scale_ptr + rows, mask=inside, other=0.0)
        x_scale = tl.load(x_scale_ptr + rows, mask=inside, other=0.0)
        shift = tl.load(shift_ptr + rows, mask=inside, other=0.0)
        out = grad * grad_scale + values * x_scale + shift
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


def _row_block(length: int) -> int:
    return min(triton.next_power_of_2(length), _MAX_BLOCK)


def row_moments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, biased variance) in fp32 of each row of a contiguous (rows, length) tensor of any float dtype."""
    mean = torch.empty(rows.shape[0], device=rows.device, dtype=torch.float32)
    var = torch.empty_like(mean)
    if rows.shape[0]:
        _row_moments_kernel[(rows.shape[0],)](rows, mean, var, rows.shape[1], BLOCK=_row_block(rows.shape[1]))
    return mean, var


def row_sums(grad: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of grad, sum of grad * rows) in fp32 per row of two contiguous (rows, length) tensors."""
    grad_sum = torch.empty(rows.shape[0], device=rows.device, dtype=torch.float32)
    grad_dot = torch.empty_like(grad_sum)
    if rows.shape[0]:
        _row_sums_kernel[(rows.shape[0],)](
            grad, rows, grad_sum, grad_dot, rows.shape[1], BLOCK=_row_block(rows.shape[1])
        )
    return grad_sum, grad_dot


def _elementwise_grid(numel: int) -> tuple[int]:
    return (triton.cdiv(numel, _ELEMENTWISE_BLOCK),)


def row_affine(rows: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """rows * scale[:, None] + shift[:, None], computed in fp32 and written in the dtype of rows; scale and shift
    are fp32 per row."""
    out = torch.empty_like(rows)
    if rows.numel():
        _row_affine_kernel[_elementwise_grid(rows.numel())](
            rows, scale, shift, out, rows.numel(), rows.shape[1], BLOCK=_ELEMENTWISE_BLOCK
        )
    return out


def row_affine2(
    grad: torch.Tensor, rows: torch.Tensor, grad_scale: torch.Tensor, rows_scale: torch.Tensor, shift: torch.Tensor
) -> torch.Tensor:
    """grad * grad_scale[:, None] + rows * rows_scale[:, None] + shift[:, None], in the dtype of rows."""
    out = torch.empty_like(rows)
    if rows.numel():
        _row_affine2_kernel[_elementwise_grid(rows.numel())](
            grad, rows, grad_scale, rows_scale, shift, out, rows.numel(), rows.shape[1], BLOCK=_ELEMENTWISE_BLOCK
        )
    return out
