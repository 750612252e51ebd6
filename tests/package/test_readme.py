"""README.md runs as written: every Python block, and every `equiconvert` command that runs on a CPU.

Where a command or block would train for minutes, the test substitutes small settings; each substitution is
listed in SMALL and must match the README, so a changed README cannot silently skip it. A Python block may not
trip the library's own warnings, except one the README says it gives (README_WARNINGS). Commands that name a
placeholder data folder (`DIR`) or several GPUs are checked for the recipe they name, not run.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from equiconvert.cli import main
from equiconvert.recipes.recipe import shipped_recipes
from tests.support.idx import make_idx_dir
from tests.support.paths import REPO_ROOT
from tests.support.snippets import library_warnings

README = (REPO_ROOT / "README.md").read_text()
FASHION_DIR = "/usr/share/datasets/fashion-mnist"

# README text -> what the test runs instead: a few steps in place of a few hundred (the Python block keeps its
# settings, so that the trainer checks them as written, and stops at a time limit)
SMALL = {
    "labels[:500]))": "labels[:500]), time_limit_s=1)",
    "--steps 300": "--steps 2",
    "--recipe cpu_main_job": "--recipe cpu_main_job --steps 2 --set run.plan_steps=false",
}
# names a block takes from the reader's own pipeline (the Opacus snippet starts from the reader's model and loader)
READERS_PIPELINE = ("model", "loader")
# block -> the start of each warning of the library's that the README says the block gives
README_WARNINGS = {2: ["opacus_interop.make_private: PrivacyEngine(secure_mode=False)"]}


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def shell_commands() -> list[str]:
    """The indented `equiconvert ...` commands, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", "", README)
    return [line.strip() for line in joined.splitlines() if line.startswith("    equiconvert ")]


def small(text: str) -> str:
    for original, replacement in SMALL.items():
        text = text.replace(original, replacement)
    return text


def readers_pipeline() -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)
    )
    data = TensorDataset(torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,)))
    return {"model": model, "loader": DataLoader(data, batch_size=16)}


def test_every_substitution_matches_the_readme():
    everything = "\n".join(python_blocks()) + "\n" + "\n".join(shell_commands())
    assert [k for k in SMALL if k not in everything] == []


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    block = small(python_blocks()[index])
    namespace = (
        readers_pipeline() if any(re.search(rf"\b{n}\b\s*=\s*[^=].*\b{n}\b", block) for n in READERS_PIPELINE) else {}
    )
    with library_warnings() as issued:
        exec(compile(block, f"README.md python block {index}", "exec"), namespace)  # noqa: S102 - the README's own
    expected = README_WARNINGS.get(index, [])
    assert len(issued) == len(expected) and all(m.startswith(e) for m, e in zip(issued, expected)), issued


def test_shell_commands_run_or_name_what_exists(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fashion = tmp_path / "fashion-mnist"
    make_idx_dir(fashion, n_train=600, n_test=50)  # more than the commands' expected batch of 256
    ran, checked = [], []
    for command in shell_commands():
        argv = shlex.split(small(command).replace(FASHION_DIR, str(fashion)))[1:]
        if "DIR" in argv or "--nproc-per-node" in argv:
            recipe = argv[argv.index("--recipe") + 1] if "--recipe" in argv else None
            assert recipe is None or recipe in shipped_recipes(), command
            checked.append(command)
            continue
        assert main(argv) == 0, (command, capsys.readouterr().err[-2000:])
        ran.append(command)
    assert ran and all(Path(a).exists() for a in ("runs/fmnist/result.json", "runs/fmnist2/result.json"))
    assert len(ran) + len(checked) == len(shell_commands())
