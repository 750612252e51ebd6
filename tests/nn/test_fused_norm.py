"""Runs tests/nn/fused_norm_interpreted.py (the Triton norm kernels in Triton's interpreter) in a fresh process.

Triton chooses between compiling and interpreting when it is first imported, which this process did
long ago, so the kernel tests need a process started with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

pytest.importorskip(
    "triton", reason="Triton ships with PyTorch's CUDA wheels on Linux; without it the kernels never run"
)

INTERPRETED_TESTS = Path(__file__).with_name("fused_norm_interpreted.py")


def test_norm_kernels_pass_under_the_triton_interpreter():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INTERPRETED_TESTS)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=600,
    )
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    summary = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in .*", summary), report  # every test ran and passed: none skipped
    assert int(summary.split()[0]) >= 15, report
