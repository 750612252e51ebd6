"""The Triton filter-gradient kernels: where they refuse to run, and (in Triton's interpreter) what it computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from equiconvert.errors import ParameterError
from equiconvert.privacy import filter_gradients
from equiconvert.privacy.filter_gradients import filter_gradient_method, per_example_filter_gradients
from tests.support.triton_interpreter import assert_passes_interpreted


@pytest.mark.parametrize("method", ["triton", "triton_taps"])
def test_the_triton_methods_on_cpu_tensors_are_refused_with_what_to_use_instead(method):
    with pytest.raises(
        ParameterError,
        match=r"Triton filter-gradient kernels need Triton and cuda tensors.*got cpu "
        r"float32.*'auto'",
    ):
        with filter_gradient_method(method):
            per_example_filter_gradients(torch.randn(4, 3, 6, 6), torch.randn(4, 5, 6, 6), 2, kernel=3, padding=1)


def test_the_triton_method_refuses_float64_wherever_it_runs(monkeypatch):
    from equiconvert.privacy import triton_filter_gradients

    monkeypatch.setattr(triton_filter_gradients, "KERNEL_DEVICES", ("cuda", "cpu"))
    inputs, grad_out = torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randn(4, 5, 6, 6, dtype=torch.float64)
    assert not filter_gradients.RUNS_ON["triton"](inputs, grad_out)
    assert not filter_gradients.RUNS_ON["triton_taps"](inputs, grad_out)
    with pytest.raises(ParameterError, match="got cpu float64"), filter_gradient_method("triton"):
        per_example_filter_gradients(inputs, grad_out, 2, kernel=3, padding=1)


def test_fastest_on_cpu_tensors_never_times_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(filter_gradients, "_fastest", {})
    timed = []
    names = {id(kernel): name for name, kernel in filter_gradients.KERNELS.items()}
    monkeypatch.setattr(filter_gradients, "_seconds", lambda kernel, *args: timed.append(names[id(kernel)]) or 1.0)
    with filter_gradient_method("fastest"):
        per_example_filter_gradients(torch.randn(4, 3, 6, 6), torch.randn(4, 5, 6, 6), 2, kernel=3, padding=1)
    assert sorted(timed) == ["grouped", "products", "unfolded"]


def test_triton_kernels_pass_under_the_triton_interpreter():
    pytest.importorskip(
        "triton", reason="Triton ships with PyTorch's CUDA wheels on Linux; without it the kernel never runs"
    )
    assert_passes_interpreted(Path(__file__).with_name("triton_filter_gradients_interpreted.py"), at_least=50)


HOPPER_SHARED_MEMORY_BYTES = 227 * 1024  # the most shared memory one block may take on an H100/H200 (sm_90)


def _compile_for_hopper(one_tap: bool, x_dtype: str, g_dtype: str, tile: tuple[int, int, int, int, int]):
    """The kernel built by Triton's CUDA compiler and ptxas for sm_90, from CPU: no GPU needed."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from equiconvert.privacy.triton_filter_gradients import _per_example_filter_gradient_kernel as kernel

    block_m, block_n, block_r, warps, stages = tile
    constants = {
        "KH": 3,
        "KW": 3,
        "ONE_TAP": one_tap,
        "INPUT_PRECISION": "tf32",
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_R": block_r,
    }
    names = list(inspect.signature(kernel.fn).parameters)
    pointers = {"x_ptr": x_dtype, "g_ptr": g_dtype, "out_ptr": g_dtype}
    signature = {
        name: "constexpr" if name in constants else f"*{pointers[name]}" if name in pointers else "i32"
        for name in names
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


@pytest.mark.parametrize("one_tap", [False, True])
@pytest.mark.parametrize(
    "x_dtype, g_dtype, tiles", [("fp32", "bf16", None), ("bf16", "bf16", None), ("fp32", "fp32", 2)]
)
def test_the_kernel_builds_for_an_h100_or_h200_in_every_tuned_tile(one_tap, x_dtype, g_dtype, tiles):
    """CI has no GPU and the interpreter skips the GPU compiler: a kernel it runs but the compiler or ptxas
    rejects, or a tile the autotuner would always find too large for the card, fails here."""
    pytest.importorskip(
        "triton", reason="Triton ships with PyTorch's CUDA wheels on Linux; without it the kernel never runs"
    )
    from equiconvert.privacy.triton_filter_gradients import _TUNED_TILES

    for tile in _TUNED_TILES[:tiles]:
        built = _compile_for_hopper(one_tap, x_dtype, g_dtype, tile)
        assert "cubin" in built.asm and ".entry" in built.asm["ptx"], tile
        assert 0 < built.metadata.shared <= HOPPER_SHARED_MEMORY_BYTES, (tile, built.metadata.shared)
