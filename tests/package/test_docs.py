"""The documentation site builds with `mkdocs build --strict` (broken links, missing pages, bad API references fail)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.support.paths import REPO_ROOT


def _nav_pages() -> list[str]:
    """The Markdown files named in mkdocs.yml's nav (read as text: the file needs no YAML loader here)."""
    return re.findall(r":\s*([\w./-]+\.md)\s*$", (REPO_ROOT / "mkdocs.yml").read_text(), flags=re.MULTILINE)


def test_every_nav_page_exists():
    pages = _nav_pages()
    assert "index.md" in pages and "api.md" in pages and "results.md" in pages
    missing = [p for p in pages if not (REPO_ROOT / "docs" / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages that docs/ lacks: {missing}"


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(REPO_ROOT / "mkdocs.yml"),
            "--site-dir",
            str(site),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (site / "index.html").is_file()
    for page in (
        "guides/conversion",
        "guides/private-training",
        "guides/reproducing-the-paper",
        "guides/performance",
        "results",
    ):
        assert (site / page / "index.html").is_file(), page
    # the stylesheet that fits wide tables (docs/results.md) is shipped and linked
    assert (site / "stylesheets" / "extra.css").is_file()
    assert "stylesheets/extra.css" in (site / "results" / "index.html").read_text()
    api = (site / "api" / "index.html").read_text()
    # mkdocstrings rendered the docstrings, not just the headings
    for name in ("make_equivariant", "check_equivariance", "DPTrainer", "DPConfig", "equivariant_resnet9"):
        assert name in api, name
    assert "Compare model(g.x) with g.model(x)" in api
