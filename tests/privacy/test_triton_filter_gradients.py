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
