"""Runs a test file of Triton kernels in a fresh process under Triton's interpreter (CI has no GPU).

Triton chooses between compiling and interpreting when it is first imported, which the test process
did long ago, so kernel tests need a process started with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO_ROOT


def require_interpreter(runner: str) -> None:
    """At the top of a file of interpreted kernel tests: refuse to run outside `runner`'s TRITON_INTERPRET=1
    process (imported into a compiling process, the kernels would be built for a GPU that CI does not have)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"run through {runner}: these tests need TRITON_INTERPRET=1 from the start")


def assert_passes_interpreted(test_file: Path, *, at_least: int) -> None:
    """Every test of test_file ran and passed under the interpreter (none skipped), and there were at_least."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=600,
    )
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    summary = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed in .*", summary), report
    assert int(summary.split()[0]) >= at_least, report
