"""The Triton kernels of the uneven field group norm, run in Triton's interpreter on CPU tensors.

CI has no GPU: the interpreter executes the same kernel source, program by program, so these tests
check the kernels' arithmetic (masks, block merging, row indexing, dtypes) and FieldGroupNorm's use
of them against the plain-torch path in float64. Triton picks the interpreter when it is imported,
so tests/nn/test_fused_norm.py runs this file in a fresh process with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import require_interpreter

require_interpreter("tests/nn/test_fused_norm.py")

from equiconvert.nn import FieldGroupNorm  # noqa: E402
from equiconvert.nn import fused_norm  # noqa: E402

assert fused_norm.triton is not None, "Triton ships with PyTorch's CUDA wheels (the pinned install)"


@pytest.fixture
def interpreted(monkeypatch):
    """CPU tensors allowed on the fused path (the interpreter runs the kernels on them)."""
    monkeypatch.setattr(fused_norm, "_KERNEL_DEVICES", ("cuda", "cpu"))


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("length", [3, 200, 2 * 2048 + 5])  # one partial block, one block, three blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_moments_equal_float64_far_from_zero(interpreted, length, dtype):
    """Block moments merged by Chan's formula: no cancellation with rows 100 standard deviations from zero."""
    rows = (100 + torch.randn(5, length, generator=torch.Generator().manual_seed(0))).to(dtype)
    mean, var = fused_norm.row_moments(rows)
    var64, mean64 = torch.var_mean(rows.double(), dim=-1, unbiased=False)
    assert mean.dtype == var.dtype == torch.float32
    assert (mean - mean64).abs().max() < 1e-5 * 100
    assert _relative(var, var64) < 1e-4


@pytest.mark.parametrize("length", [7, 2 * 2048 + 5])
def test_row_sums_equal_float64(interpreted, length):
    generator = torch.Generator().manual_seed(1)
    grad, rows = torch.randn(4, length, generator=generator), torch.randn(4, length, generator=generator).bfloat16()
    grad_sum, grad_dot = fused_norm.row_sums(grad, rows)
    assert _relative(grad_sum, grad.double().sum(-1)) < 1e-5
    assert _relative(grad_dot, (grad.double() * rows.double()).sum(-1)) < 1e-5


def _forward_backward(norm: FieldGroupNorm, x: torch.Tensor, upstream: torch.Tensor):
    inputs = x.clone().requires_grad_(True)
    out = norm(inputs)
    (grad,) = torch.autograd.grad((out * upstream.to(out.dtype)).sum(), inputs)
    return out, grad, inputs


@pytest.mark.parametrize(
    "num_fields, field_size, num_groups, size", [(13, 8, 8, 6), (5, 4, 2, 3), (39, 8, 8, 2), (6, 8, 6, 4)]
)
def test_fused_norm_equals_the_torch_path_in_float64(interpreted, num_fields, field_size, num_groups, size):
    """Forward and input gradient of the fused fp32 path within 1e-5 of the torch path run in float64 (uneven
    groups; and even ones, where the torch path is F.group_norm)."""
    generator = torch.Generator().manual_seed(2)
    x = 3 + 2 * torch.randn(3, num_fields * field_size, size, size, generator=generator, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    norm = FieldGroupNorm(num_fields, field_size, num_groups, affine=True, eps=1e-2).double()
    with torch.no_grad():
        norm.weight.normal_(generator=generator)
        norm.bias.normal_(generator=generator)
    expected_out, expected_grad, _ = _forward_backward(norm, x, upstream)  # float64: the torch path
    out, grad, inputs = _forward_backward(norm.float(), x.float(), upstream)
    assert _fused_in_graph(out)
    assert _relative(out, expected_out) < 1e-5
    assert _relative(grad, expected_grad) < 1e-5


def _fused_in_graph(out: torch.Tensor) -> bool:
    """Whether the autograd graph of out contains the fused standardization's backward."""
    pending, seen = [out.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "_FusedFieldGroupStandardization" in type(node).__name__:
            return True
        pending.extend(next_node for next_node, _ in node.next_functions)
    return False


def test_fused_norm_takes_bf16_in_and_returns_bf16_out_with_a_bf16_gradient(interpreted):
    """Under autocast the activations arrive in bf16: read as they are (no fp32 copy), output and input gradient
    written in bf16, the output within one bf16 rounding of the same kernels' fp32 output (statistics in fp32),
    the gradient within bf16 rounding of float64."""
    generator = torch.Generator().manual_seed(3)
    x = (1 + torch.randn(2, 13 * 8, 4, 4, generator=generator)).bfloat16()
    upstream = torch.randn(x.shape, generator=generator)
    norm = FieldGroupNorm(13, 8, 8, affine=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grad, _ = _forward_backward(norm, x, upstream)
    assert _fused_in_graph(out)
    assert out.dtype == torch.bfloat16 and grad.dtype == torch.bfloat16
    fp32_out = norm(x.float()).bfloat16()  # the same kernels on the exact fp32 values, rounded once
    assert (out.float() - fp32_out.float()).abs().max() <= fp32_out.float().abs().max() * 2**-7
    expected_out, expected_grad, _ = _forward_backward(norm.double(), x.double(), upstream.double())
    assert _relative(out, expected_out) < 1e-2  # one bf16 rounding of statistics taken in fp32
    assert _relative(grad, expected_grad) < 1e-2  # one bf16 rounding of the gradient


def test_fused_norm_is_not_used_for_float64_or_under_torch_func(interpreted):
    """float64 keeps the torch path's precision; torch.func transforms (vmap per-sample gradients) cannot trace a
    Triton launch, so they get the torch path, and their per-sample gradients equal the fused path's."""
    norm = FieldGroupNorm(5, 4, 2, affine=True)
    x = torch.randn(3, 20, 3, 3, generator=torch.Generator().manual_seed(4))
    assert not _fused_in_graph(norm.double()(x.double().requires_grad_(True)))
    norm.float()
    assert _fused_in_graph(norm(x.clone().requires_grad_(True)))

    def loss(weight, sample):
        return torch.func.functional_call(norm, {"weight": weight, "bias": norm.bias}, (sample[None],)).pow(2).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(norm.weight, x)
    one_by_one = torch.stack([torch.autograd.grad(loss(norm.weight, sample), norm.weight)[0] for sample in x])
    assert torch.allclose(per_sample, one_by_one, atol=1e-5)


def test_fused_norm_second_derivatives_follow_the_torch_path(interpreted):
    """A graph of the backward (create_graph) is built from plain torch ops: double backward still works."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(2, 13 * 4, 3, 3, generator=generator)
    direction = torch.randn(x.shape, generator=generator)
    norm = FieldGroupNorm(13, 4, 8, affine=False)

    def second(module: FieldGroupNorm, inputs: torch.Tensor) -> torch.Tensor:
        inputs = inputs.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(module(inputs).pow(3).sum(), inputs, create_graph=True)
        return torch.autograd.grad((grad * direction.to(inputs.dtype)).sum(), inputs)[0]

    assert _relative(second(norm, x), second(norm.double(), x.double())) < 1e-4


def test_fused_norm_handles_an_empty_batch(interpreted):
    x = torch.randn(0, 20, 3, 3, requires_grad=True)
    out = FieldGroupNorm(5, 4, 2)(x)
    out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape


@pytest.mark.parametrize("num_fields, field_size, num_groups, size", [(13, 8, 8, 8), (6, 8, 6, 6), (39, 4, 8, 5)])
def test_norm_then_pool_on_the_kernels_equals_the_pair_in_float64(
    interpreted, monkeypatch, num_fields, field_size, num_groups, size
):
    """FieldGroupNormMaxPool2d on the kernels (fp32): output and input gradient within 1e-5 of FieldGroupNorm then
    the window max pool, run in float64 on the torch path."""
    from torch import nn

    from equiconvert.nn import FieldGroupNormMaxPool2d, WindowMaxPool2d

    generator = torch.Generator().manual_seed(5)
    x = 3 + 2 * torch.randn(2, num_fields * field_size, size, size, generator=generator, dtype=torch.float64)
    upstream = torch.randn(2, num_fields * field_size, size // 2, size // 2, generator=generator, dtype=torch.float64)
    norm = FieldGroupNorm(num_fields, field_size, num_groups, affine=False)
    expected_out, expected_grad, _ = _forward_backward(nn.Sequential(norm, WindowMaxPool2d(2)).double(), x, upstream)
    norm.float()
    called: list[str] = []
    for name in ("row_moments", "row_affine", "row_sums", "row_affine2"):
        kernel = getattr(fused_norm, name)
        monkeypatch.setattr(fused_norm, name, lambda *a, _k=kernel, _n=name: called.append(_n) or _k(*a))
    out, grad, _ = _forward_backward(FieldGroupNormMaxPool2d(norm, 2), x.float(), upstream)
    assert sorted(set(called)) == ["row_affine", "row_affine2", "row_moments", "row_sums"]
    assert out.dtype == grad.dtype == torch.float32
    assert _relative(out, expected_out) < 1e-5
    assert _relative(grad, expected_grad) < 1e-5
