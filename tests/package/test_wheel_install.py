"""Acceptance: the built wheel installs into a fresh Python 3.13 + NumPy 2 venv without escnn or compilers,
converts resnet18 to C4, D4, C8, D8, D16 and O2 (exactly invariant on grid elements) and runs a DP step."""

import glob
import os
import subprocess
import sys

import pytest

from tests.support.paths import REPO_ROOT

PYTHONS = sorted(glob.glob("/root/.pyenv/versions/3.13.*/bin/python"))

SCRIPT = r"""
import sys, numpy, torch, torchvision
assert int(numpy.__version__.split(".")[0]) >= 2, numpy.__version__
import equiconvert
assert "escnn" not in sys.modules
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


@pytest.mark.slow
@pytest.mark.skipif(not PYTHONS, reason="needs a pyenv Python 3.13 (/root/.pyenv/versions/3.13.*)")
def test_wheel_installs_on_python313_numpy2_without_escnn(tmp_path):
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(REPO_ROOT))
    wheel = next((tmp_path / "dist").glob("equiconvert-*.whl"))
    venv = tmp_path / "venv"
    _run(PYTHONS[-1], "-m", "venv", str(venv))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--only-binary=:all:"]
    env = {**os.environ, "PATH": f"{venv / 'bin'}:/usr/bin:/bin"}  # no Fortran compiler needed or used
    _run(*pip, "numpy>=2", env=env)
    _run(*pip, str(wheel), "torch==2.14.1", "torchvision==0.29.1", env=env)
    out = _run(str(venv / "bin" / "python"), "-c", SCRIPT, env={**env, "EQUICONVERT_CACHE_DIR": str(tmp_path / "c")})
    assert out.count("invariant") == 6 and "dp step ok" in out
