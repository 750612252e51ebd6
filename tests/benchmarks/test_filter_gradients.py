"""benchmarks/filter_gradients.py times every kernel that runs on the device and lists the ones that cannot."""

import json

import pytest
import torch

from tests.support.benchmark_scripts import load_benchmark


@pytest.fixture
def matmul_tf32_restored():
    """The script sets matmuls to the convolutions' TF32 setting for the process: set back after the test."""
    before = torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_every_kernel_that_runs_on_cpu_is_timed_and_checked_and_the_triton_kernels_are_listed_as_not_run(
    tmp_path, capsys, matmul_tf32_restored
):
    out = tmp_path / "filter_gradients.json"
    benchmark = load_benchmark("filter_gradients")
    args = ["--device", "cpu", "--batch", "1", "--aug-mult", "2", "--iters", "1", "--out", str(out)]
    assert benchmark.main(args) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["not_run"] == ["triton", "triton_taps"]  # CUDA only
    assert [(row["c_in"], row["c_out"], row["size"]) for row in report["rows"]] == benchmark.SHAPES
    for row in report["rows"]:
        for kernel in ("products", "grouped", "unfolded"):
            assert row[f"{kernel}_ms"] > 0 and row[f"{kernel}_relative_error"] < 1e-5, (row, kernel)
        assert not any(key.startswith("triton") for key in row)
