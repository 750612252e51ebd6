"""Per-example gradients of a dense conv filter from the layer's input and output gradient.

Book-keeping and the Opacus grad sampler of SteerableConv2d both need, for every example,
the filter gradient sum over its views and positions of (output gradient x input patch).
Unfolding the input into patches copies it k*k times and is memory-bound on a GPU; for
stride-1 convolutions this module instead runs one batched product per filter tap on a
shifted, strided view of the padded input (benchmarks/filter_gradients.py compares them).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.func import vjp, vmap

from ..nn.conv import SteerableConv2d

IntPair = int | tuple[int, int]


def pair(value: IntPair) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def per_example_filter_gradients(
    inputs: torch.Tensor,
    grad_out: torch.Tensor,
    views: int,
    *,
    kernel: IntPair,
    stride: IntPair = 1,
    padding: IntPair = 0,
    dilation: IntPair = 1,
    padding_mode: str = "zeros",
    groups: int = 1,
) -> torch.Tensor:
    """(B, C_out, C_in/groups, kh, kw): each example's filter gradient of a conv, summed over its K views.

    inputs (B*K, C_in, H, W) and grad_out (B*K, C_out, H', W') hold each example's K views
    consecutively; neither is differentiated through. The result may be a strided view:
    consumers reshape it once, into the layout they need.
    """
    kernel, stride, dilation, padding = pair(kernel), pair(stride), pair(dilation), pair(padding)
    inputs, grad_out = inputs.detach(), grad_out.detach()
    if padding_mode != "zeros":  # the layer pads with F.pad, then convolves without padding
        inputs = F.pad(inputs, (padding[1], padding[1], padding[0], padding[0]), mode=padding_mode)
        padding = (0, 0)
    if stride == (1, 1) and dilation == (1, 1) and groups == 1:
        return _shifted_products(inputs, grad_out, views, kernel, padding)
    columns = F.unfold(inputs, kernel, dilation=dilation, padding=padding, stride=stride)  # (N, C_in k k, L)
    batch, positions = inputs.shape[0] // views, columns.shape[2]
    if grad_out.shape[-2] * grad_out.shape[-1] != positions:
        raise ValueError(f"output gradient of size {tuple(grad_out.shape[-2:])} does not match the {positions} "
                         f"positions of a {kernel} conv (stride {stride}, dilation {dilation}) of its input")
    columns = columns.reshape(batch, views, groups, columns.shape[1] // groups, positions)
    grad_out = grad_out.reshape(batch, views, groups, grad_out.shape[1] // groups, positions)  # (B, K, G, C_out/G, L)
    dense = torch.einsum("bkgol,bkgdl->bgod", grad_out, columns)
    return dense.reshape(batch, grad_out.shape[2] * grad_out.shape[3], inputs.shape[1] // groups, *kernel)


def steerable_weight_gradients(module: SteerableConv2d, filters: torch.Tensor) -> torch.Tensor:
    """Per-example gradients of module.weight from those of its expanded filter (B, C_out, C_in/groups, k, k).

    The transpose of SteerableConv2d.expand_filter: the basis contraction, then the
    vector-Jacobian product of the weight standardization when the layer has it.
    Returns (B, out_fields, in_fields/groups, num_basis).
    """
    batch, k = filters.shape[0], module.kernel_size
    blocks = filters.reshape(batch, module.out_fields, module.out_size, -1, module.in_size, k, k)
    coefficients = torch.einsum("bxsyijk,nsijk->bxyn", blocks, module.basis.to(filters.dtype))
    if not module.weight_standardization or batch == 0:
        return coefficients
    _, standardization_vjp = vjp(module.coefficients, module.weight.detach().to(filters.dtype))
    return vmap(lambda g: standardization_vjp(g)[0])(coefficients)


def _shifted_products(
    inputs: torch.Tensor, grad_out: torch.Tensor, views: int, kernel: tuple[int, int], padding: tuple[int, int]
) -> torch.Tensor:
    """The stride-1 case without unfolding: one batched product per filter tap.

    The padded input and the output gradient (placed at the top-left of a grid of the padded
    size) are flattened per example over (views, rows, columns). In that flat layout, filter
    tap (dy, dx) reads the input shifted by dy * padded_width + dx, so its per-example gradient
    is one `bmm` of the output gradient with a strided view of the input: k*k products, no
    k*k-fold copy of the input. Positions the shift carries past a row or view meet zeros
    of the placed gradient, and a zero tail keeps the last shift inside the buffer.
    """
    (kh, kw), (ph, pw) = kernel, padding
    total, channels_in, height, width = inputs.shape
    channels_out, out_h, out_w = grad_out.shape[1:]
    batch = total // views
    padded_h, padded_w = height + 2 * ph, width + 2 * pw
    if (out_h, out_w) != (padded_h - kh + 1, padded_w - kw + 1):
        raise ValueError(f"output gradient of size {out_h}x{out_w} does not fit a {kh}x{kw} stride-1 conv of a "
                         f"{height}x{width} input padded by {ph}, {pw}")
    grid = padded_h * padded_w
    tail = (kh - 1) * padded_w + (kw - 1)
    flat_inputs = inputs.new_zeros(batch, channels_in, views * grid + tail)
    flat_inputs[:, :, : views * grid].view(batch, channels_in, views, padded_h, padded_w)[
        :, :, :, ph : ph + height, pw : pw + width
    ] = inputs.reshape(batch, views, channels_in, height, width).transpose(1, 2)
    placed = grad_out.new_zeros(batch, channels_out, views, padded_h, padded_w)
    placed[:, :, :, :out_h, :out_w] = grad_out.reshape(batch, views, channels_out, out_h, out_w).transpose(1, 2)
    placed = placed.view(batch, channels_out, views * grid)
    size, strides = (batch, views * grid, channels_in), (flat_inputs.stride(0), 1, flat_inputs.stride(1))
    start = flat_inputs.storage_offset()
    # Taps are written in place into (B, C_out, taps, C_in): each tap's (C_out, C_in) block is a matrix with
    # leading dimension taps * C_in, which cuBLAS writes directly (stacking taps last would copy everything).
    by_tap = placed.new_empty(batch, channels_out, kh * kw, channels_in)
    with matmuls_in_convolution_precision(inputs.is_cuda):
        for tap in range(kh * kw):
            shift = (tap // kw) * padded_w + tap % kw
            torch.bmm(placed, flat_inputs.as_strided(size, strides, start + shift), out=by_tap[:, :, tap])
    return by_tap.view(batch, channels_out, kh, kw, channels_in).permute(0, 1, 4, 2, 3)


@contextlib.contextmanager
def matmuls_in_convolution_precision(enabled: bool) -> Iterator[None]:
    """Run fp32 matmuls in TF32 inside the block when convolutions run in TF32 and matmuls in full fp32.

    The products here are a convolution's weight gradient, per example; cuDNN computes that
    gradient in TF32 unless `torch.backends.cudnn.allow_tf32` is off, while fp32 matmuls default to
    full precision (and run ~1.6x slower on an H100/H200). Only PyTorch's default state is
    changed, and restored on exit: if the user chose a matmul precision, or uses the per-backend
    `fp32_precision` settings (reading the legacy flags then raises), nothing is touched. The flag
    is process-wide, so matmuls of other threads inside the block run in TF32 too.
    """
    if not enabled:
        yield
        return
    try:
        switch = (torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
                  and torch.get_float32_matmul_precision() == "highest")
    except RuntimeError:  # settings made through the per-backend API: leave them as they are
        switch = False
    if not switch:
        yield
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
