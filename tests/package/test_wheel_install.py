"""Acceptance: the built wheel installs into fresh Python 3.10 and 3.13 venvs with NumPy 2 and without escnn or
compilers, loads a shipped recipe (tomli on 3.10, tomllib later), converts resnet18 to C4, D4, C8, D8, D16 and O2
(exactly invariant on grid elements) and runs a DP step.

The interpreters come from pyenv ($PYENV_ROOT, default ~/.pyenv: versions/3.10.*, versions/3.13.*); a missing one
fails the test. EQUICONVERT_INSTALL_PYTHONS (e.g. "3.13") names the versions to test where not all are installed.
"""

import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import REPO_ROOT

VERSIONS = ("3.10", "3.13")


def _interpreter(version: str) -> str:
    """The newest pyenv Python `version`.*; fails (never skips) when it is missing and was not deselected."""
    selected = os.environ.get("EQUICONVERT_INSTALL_PYTHONS", ",".join(VERSIONS))
    if version not in selected.split(","):
        pytest.skip(f"EQUICONVERT_INSTALL_PYTHONS={selected} leaves out Python {version}")
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    found = sorted(
        glob.glob(str(root / "versions" / f"{version}.*" / "bin" / "python")),
        key=lambda path: [int(part) for part in Path(path).parents[1].name.split(".") if part.isdigit()],
    )
    if not found:
        pytest.fail(
            f"no Python {version} under {root}/versions: install it (`pyenv install {version}`) or name the "
            f"versions to test in EQUICONVERT_INSTALL_PYTHONS (now {selected})"
        )
    return found[-1]


SCRIPT = r"""
import sys, numpy, torch, torchvision
assert int(numpy.__version__.split(".")[0]) >= 2, numpy.__version__
import equiconvert
from equiconvert.recipes.recipe import load_recipe, shipped_recipes
recipe = load_recipe("cpu_main_job")
assert recipe.conversion.group and len(shipped_recipes()) >= 1
assert ("tomli" if sys.version_info < (3, 11) else "tomllib") in sys.modules
print("recipe", recipe.model.name, recipe.conversion.group, flush=True)
assert "escnn" not in sys.modules
torch.manual_seed(0)  # fixed weights and probe inputs: unseeded, float32 rounding through resnet18 sometimes passed 1e-5
for group in ["C4", "D4", "C8", "D8", "D16", "O2"]:
    model = equiconvert.make_equivariant(torchvision.models.resnet18(num_classes=10), group).eval()
    result = equiconvert.check_equivariance(model, input_size=model.default_input_size())
    assert result.max_error <= 1e-5, (group, result.errors)
    print(group, "invariant", flush=True)
from opacus import PrivacyEngine
model = equiconvert.make_equivariant(torchvision.models.resnet18(num_classes=10), "D4").train()
data = torch.utils.data.TensorDataset(torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
loader = torch.utils.data.DataLoader(data, batch_size=4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer, loader = PrivacyEngine().make_private(
    module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
x, y = next(iter(loader))
torch.nn.functional.cross_entropy(model(x), y).backward()
optimizer.step()
assert all(torch.isfinite(p).all() for p in model.parameters())
print("dp step ok")
"""


def _run(*command: str, **kwargs) -> str:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO_ROOT))
    built = next(dist.glob("equiconvert-*.whl"))
    print(f"{built.name}: {built.stat().st_size / 1e3:.0f} kB")
    return built


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS, ids=[f"py{v.replace('.', '')}" for v in VERSIONS])
def test_wheel_installs_with_numpy2_without_escnn(version, tmp_path, request):
    python = _interpreter(version)
    wheel = request.getfixturevalue("wheel")  # built once, after the interpreter is known to exist
    start = time.perf_counter()
    venv = tmp_path / "venv"
    try:
        _run(python, "-m", "venv", str(venv))
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--only-binary=:all:"]
        env = {**os.environ, "PATH": f"{venv / 'bin'}:/usr/bin:/bin"}  # no Fortran compiler needed or used
        _run(*pip, "numpy>=2", env=env)
        _run(*pip, str(wheel), "torch==2.14.1", "torchvision==0.29.1", env=env)
        installed = time.perf_counter()
        out = _run(
            str(venv / "bin" / "python"), "-c", SCRIPT, env={**env, "EQUICONVERT_CACHE_DIR": str(tmp_path / "c")}
        )
        print(f"{out}venv and install {installed - start:.0f} s, run {time.perf_counter() - installed:.0f} s")
        assert version in _run(str(venv / "bin" / "python"), "--version")
        assert out.count("invariant") == 6 and "dp step ok" in out and "recipe " in out
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # 5-6 GB of torch per venv; never left on disk


def test_a_missing_interpreter_fails_with_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    monkeypatch.delenv("EQUICONVERT_INSTALL_PYTHONS", raising=False)
    with pytest.raises(
        pytest.fail.Exception, match=r"no Python 3\.10 under .*pyenv install 3\.10.*EQUICONVERT_INSTALL"
    ):
        _interpreter("3.10")
    (tmp_path / "versions" / "3.10.2" / "bin").mkdir(parents=True)
    (tmp_path / "versions" / "3.10.2" / "bin" / "python").touch()
    (tmp_path / "versions" / "3.10.11" / "bin").mkdir(parents=True)
    (tmp_path / "versions" / "3.10.11" / "bin" / "python").touch()
    assert _interpreter("3.10") == str(tmp_path / "versions" / "3.10.11" / "bin" / "python")  # newest, not "3.10.2"
