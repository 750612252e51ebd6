"""Runs tests/nn/fused_norm_interpreted.py (the Triton norm kernels in Triton's interpreter) in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.triton_interpreter import assert_passes_interpreted

pytest.importorskip(
    "triton", reason="Triton ships with PyTorch's CUDA wheels on Linux; without it the kernels never run"
)


def test_norm_kernels_pass_under_the_triton_interpreter():
    assert_passes_interpreted(Path(__file__).with_name("fused_norm_interpreted.py"), at_least=15)
