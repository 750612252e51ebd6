"""The Triton per-example filter-gradient kernels, run in Triton's interpreter on CPU tensors.

The interpreter executes the same kernel source program by program, so these tests check their index
arithmetic (tiles, masks, padding, stride, dilation, views, memory layouts, dtypes) against a
per-example autograd loop. tests/privacy/test_triton_filter_gradients.py runs this file in a fresh
process with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interpreter import require_interpreter

require_interpreter("tests/privacy/test_triton_filter_gradients.py")

from equiconvert.privacy import filter_gradients, triton_filter_gradients  # noqa: E402
from equiconvert.privacy.filter_gradients import filter_gradient_method, per_example_filter_gradients  # noqa: E402
from tests.privacy.test_filter_gradients import GEOMETRIES, conv_case, naive_filter_gradients  # noqa: E402

assert triton_filter_gradients.triton is not None, "Triton ships with PyTorch's CUDA wheels (the pinned install)"


@pytest.fixture
def interpreted(monkeypatch):
    """CPU tensors allowed on the kernel (the interpreter runs it on them)."""
    monkeypatch.setattr(triton_filter_gradients, "KERNEL_DEVICES", ("cuda", "cpu"))


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


METHODS = ["triton", "triton_taps"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("c_in, c_out, size, conv", GEOMETRIES)
@pytest.mark.parametrize("views", [1, 3])
def test_each_triton_kernel_equals_a_per_example_autograd_loop_in_float32(
    interpreted, method, c_in, c_out, size, conv, views
):
    inputs, grad_out, kernel, conv, expected = conv_case(c_in, c_out, size, conv, views, dtype=torch.float32)
    with filter_gradient_method(method):
        got = per_example_filter_gradients(inputs, grad_out, views, kernel=kernel, **conv)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert _relative(got, expected) < 1e-5


@pytest.mark.parametrize("layout", ["patch columns", "one tap"])
@pytest.mark.parametrize("views", [1, 3])
def test_several_tiles_and_a_partial_reduction_block(interpreted, layout, views):
    """40 output and 36 input channels (36 x 9 columns) span two 32-wide tiles or more; 5x5 x views positions end
    mid-block."""
    inputs, grad_out, kernel, conv, expected = conv_case(
        36, 40, 5, dict(kernel=3, padding=1), views, seed=3, dtype=torch.float32
    )
    got = triton_filter_gradients.triton_filter_gradients(
        inputs, grad_out, views, layout=layout, kernel=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1)
    )
    assert _relative(got, expected) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_any_memory_layout_gives_the_same_gradients(interpreted, method):
    inputs, grad_out, kernel, conv, expected = conv_case(
        6, 10, 8, dict(kernel=3, padding=1), 2, seed=4, dtype=torch.float32
    )
    last = torch.channels_last
    for x, g in [(inputs.to(memory_format=last), grad_out), (inputs, grad_out.to(memory_format=last))]:
        with filter_gradient_method(method):
            got = per_example_filter_gradients(x, g, 2, kernel=3, padding=1)
        assert _relative(got, expected) < 1e-5
    transposed = inputs.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, rows and columns swapped
    with filter_gradient_method(method):
        assert _relative(per_example_filter_gradients(transposed, grad_out, 2, kernel=3, padding=1), expected) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_16_bit_gradients_with_fp32_activations_as_under_autocast(interpreted, method):
    """The input is cast to the gradient's dtype inside the kernel; the result is in the gradient's dtype.

    float16 stands in for bf16, which takes the same code path: the interpreter's tl.dot multiplies bf16
    operands as their raw bit patterns (numpy has no bf16), so bf16 is checked on a GPU only
    (benchmarks/filter_gradients.py --dtype bf16 reports each kernel's error).
    """
    inputs, grad_out, kernel, conv, _ = conv_case(6, 10, 8, dict(kernel=3, padding=1), 2, seed=5, dtype=torch.float32)
    grad_half = grad_out.half()
    expected = naive_filter_gradients(inputs.half().double(), grad_half.double(), 2, (10, 6, 3, 3), padding=1)
    with filter_gradient_method(method):
        got = per_example_filter_gradients(inputs, grad_half, 2, kernel=3, padding=1)
    assert got.dtype == torch.float16
    assert _relative(got, expected) < 2e-3  # the accumulation is fp32; only the result is rounded to 16 bits


@pytest.mark.parametrize("method", METHODS)
def test_an_empty_batch_gives_an_empty_result(interpreted, method):
    with filter_gradient_method(method):
        got = per_example_filter_gradients(torch.randn(0, 3, 6, 6), torch.randn(0, 4, 6, 6), 2, kernel=3, padding=1)
    assert got.shape == (0, 4, 3, 3, 3)


@pytest.mark.parametrize("fastest", METHODS)
def test_fastest_times_the_triton_kernels_where_they_run_and_keeps_one_when_fastest(interpreted, monkeypatch, fastest):
    monkeypatch.setattr(filter_gradients, "_fastest", {})
    timings = {"products": 2.0, "grouped": 3.0, "unfolded": 4.0, "triton": 1.5, "triton_taps": 1.5, fastest: 1.0}
    names = {id(kernel): name for name, kernel in filter_gradients.KERNELS.items()}
    timed = []

    def seconds(kernel, *args):
        timed.append(names[id(kernel)])
        return timings[names[id(kernel)]]

    monkeypatch.setattr(filter_gradients, "_seconds", seconds)
    inputs, grad_out, kernel, conv, expected = conv_case(
        3, 5, 7, dict(kernel=3, padding=1), 2, seed=6, dtype=torch.float32
    )
    with filter_gradient_method("fastest"):
        got = per_example_filter_gradients(inputs, grad_out, 2, kernel=3, padding=1)
    assert sorted(timed) == sorted(timings)
    assert list(filter_gradients.fastest_choices().values()) == [fastest]
    assert _relative(got, expected) < 1e-5
