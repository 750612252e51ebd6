"""Max pooling over non-overlapping windows with a scatter backward: the same values and gradients, faster.

For regular fields a spatial max pool acts channel by channel, so it stays equivariant as it is; only its
backward is slow. PyTorch's CUDA max-pool backward (NCHW) visits every input element and searches the
windows that could hold it; when windows do not overlap (kernel == stride, no padding or dilation), each
input element lies in exactly one window, and the gradient is one scatter of the output gradient to the
recorded argmax positions into zeros. Same indices as max_pool2d, so outputs and gradients are identical,
ties included; under torch.func transforms (vmap per-sample gradients) the plain max_pool2d runs.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn


class _WindowMaxPool(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
        return F.max_pool2d(x, kernel, kernel, return_indices=True)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, _ = inputs
        _, indices = output
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.input_shape = x.shape

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _indices_grad: torch.Tensor | None):
        (indices,) = ctx.saved_tensors
        zeros = grad.new_zeros(ctx.input_shape)  # (N, C, H, W) or unbatched (C, H, W): indices run over H * W
        grad_input = zeros.flatten(-2).scatter(-1, indices.flatten(-2), grad.flatten(-2))  # one window per element
        return grad_input.view(ctx.input_shape), None


def window_max_pool2d(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """F.max_pool2d(x, kernel, kernel) with the scatter backward where autograd will need it."""
    if not (torch.is_grad_enabled() and x.requires_grad) or torch._C._functorch.is_functorch_wrapped_tensor(x):
        return F.max_pool2d(x, kernel, kernel)
    return _WindowMaxPool.apply(x, kernel)[0]


torch.fx.wrap("window_max_pool2d")  # traced models call it, as they call F.max_pool2d


class WindowMaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d(kernel) with stride == kernel and no padding or dilation, through window_max_pool2d."""

    def __init__(self, kernel_size: int) -> None:
        super().__init__(kernel_size, kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return window_max_pool2d(x, self.kernel_size)
