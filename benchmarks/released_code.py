"""The paper's released code (hlzl/equivariant) on this machine: where the user's checkout is, its configuration as
hydra composes it, the lines that set a value, and its model built on the CPU.

Nothing of it is copied here: the checkout is imported at run time, with shims for what its model does not need on
the CPU (scikit-image, einops' two reshapes, its hard-coded CUDA device) and for scikit-learn's refusal of
np.matrix.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from equiconvert.errors import EquiconvertError  # noqa: E402

ENV_VAR = "EQUICONVERT_RELEASED_CODE"
RELEASED_REPO = "hlzl/equivariant"
RELEASED_COMMIT = "3dd7cd0"


class ReleasedCodeError(EquiconvertError):
    """The released checkout is missing, or not the code this benchmark reads."""


def released_dir(given: str | os.PathLike | None) -> Path:
    """The checkout named by --released or $EQUICONVERT_RELEASED_CODE; a clear error when there is none."""
    path = given or os.environ.get(ENV_VAR)
    if not path:
        raise ReleasedCodeError(
            f"no checkout of the released code: pass --released DIR or set {ENV_VAR}=DIR to a clone of "
            f"github.com/{RELEASED_REPO} at commit {RELEASED_COMMIT}"
        )
    root = Path(path)
    if not (root / "networks" / "equivariant_resnet9.py").is_file():
        raise ReleasedCodeError(f"{root} is not a checkout of {RELEASED_REPO}: networks/equivariant_resnet9.py missing")
    return root


def released_commit(root: Path) -> str | None:
    """The checkout's commit, or None where it is not a git work tree."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def _install_shims() -> None:
    """Modules the released model imports but does not run here: scikit-image (its equivariance self-check) and
    einops (two reshapes in its GroupNorm, given here as the reshapes they are)."""
    if "skimage" not in sys.modules:
        skimage = types.ModuleType("skimage")
        for name, attr in (("measure", "block_reduce"), ("transform", "resize")):
            sub = types.ModuleType(f"skimage.{name}")
            setattr(sub, attr, None)
            setattr(skimage, name, sub)
            sys.modules[f"skimage.{name}"] = sub
        sys.modules["skimage"] = skimage
    try:
        import einops  # noqa: F401
    except ImportError:
        shim = types.ModuleType("einops")

        def rearrange(tensor: torch.Tensor, pattern: str, **sizes: int) -> torch.Tensor:
            if pattern == "B (C F) H W -> B C F H W":
                return tensor.reshape(tensor.shape[0], sizes["C"], -1, *tensor.shape[2:])
            if pattern == "B C F H W -> B (C F) H W":
                return tensor.flatten(1, 2)
            raise NotImplementedError(f"einops shim: pattern {pattern!r}")

        shim.rearrange, shim.repeat, shim.reduce = rearrange, None, None
        sys.modules["einops"] = shim


@contextlib.contextmanager
def _cpu_device() -> Iterator[None]:
    """The released modules move constants to f"cuda:{current_device()}" when built: keep them on the CPU."""
    to, cuda, current = torch.Tensor.to, torch.Tensor.cuda, torch.cuda.current_device

    def to_cpu(self, *args, **kwargs):
        if args and isinstance(args[0], str) and args[0].startswith("cuda"):
            args = ("cpu", *args[1:])
        return to(self, *args, **kwargs)

    torch.Tensor.to, torch.Tensor.cuda, torch.cuda.current_device = to_cpu, lambda self, *a, **k: self, lambda: 0
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.cuda, torch.cuda.current_device = to, cuda, current


def import_released(root: Path) -> types.ModuleType:
    """The released `networks` package (and its escnn fork `equivariant`), importable on this machine."""
    _install_shims()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import numpy as np

    import equivariant.group_theory.operations.numerical as numerical  # the released fork's

    svd = getattr(numerical, "randomized_svd", None)
    if svd is not None and not getattr(svd, "_accepts_matrix", False):  # scikit-learn >= 1.4 refuses np.matrix

        def randomized_svd(matrix, **kwargs):
            return svd(np.asarray(matrix), **kwargs)

        randomized_svd._accepts_matrix = True
        numerical.randomized_svd = randomized_svd
    import networks

    return networks


def released_model(root: Path, seed: int = 0) -> nn.Module:
    """The released EquivariantResNet9 with its CIFAR-10 configuration (layout, GroupNorm groups, group, rotation,
    restriction, fix_params read from conf/setup), built on the CPU (moved_everywhere takes it to a device).

    Its escnn fork draws the signs of some D4 basis filters from numpy's global generator (which the released
    configuration leaves unseeded, hardware.deterministic: False), so numpy is seeded as well: the same model, and
    the same coordinates under its weight standardization, every run."""
    import numpy as np

    networks = import_released(root)
    config = released_config(root)
    net = config["network"]
    kwargs = {k: net[k] for k in ("group", "rotation", "restrict", "fix_params")}
    torch.manual_seed(seed)
    np.random.seed(seed)
    with _cpu_device(), contextlib.redirect_stdout(sys.stderr):  # its GroupNorm prints the groups it adapts
        return networks.EquivariantResNet9(
            **kwargs, layout=tuple(net["layout"]), num_groups=tuple(net["num_groups"]), num_classes=10
        ).eval()


def moved_everywhere(module: nn.Module, device: torch.device | str, _seen: set[int] | None = None) -> nn.Module:
    """`module` on `device` with every tensor it holds: its parameters and buffers, and the tensors and modules its
    released modules keep in plain attributes, dicts and lists (sampled bases, indices).

    The walk goes by identity through each module's own dicts. `Module.to` walks the children through a set, and the
    released basis modules compare equal when their indices are: it moves one of each equal set and leaves the rest.
    """
    seen = set() if _seen is None else _seen
    if id(module) in seen:
        return module
    seen.add(id(module))

    def moved(value: Any) -> Any:
        if isinstance(value, nn.Module):
            return moved_everywhere(value, device, seen)
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, dict):
            return {key: moved(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(moved(item) for item in value)
        return value

    for name, param in module._parameters.items():
        if param is not None:
            module._parameters[name] = nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
    for name, buffer in module._buffers.items():
        if buffer is not None:
            module._buffers[name] = buffer.to(device)
    for child in module._modules.values():
        if child is not None:
            moved_everywhere(child, device, seen)
    for name, value in list(vars(module).items()):
        if name not in ("_parameters", "_buffers", "_modules") and isinstance(value, (torch.Tensor, dict, list)):
            setattr(module, name, moved(value))
    return module


def released_config(root: Path) -> dict[str, Any]:
    """The CIFAR-10 setup as hydra composes it: the network file, then the setup's overrides."""
    import yaml

    setup = yaml.safe_load((root / "conf/setup/eqresnet9-cifar10.yaml").read_text())
    network = yaml.safe_load((root / "conf/setup/network/resnet9_equivariant.yaml").read_text())
    network.update(setup.get("network", {}))
    optim = yaml.safe_load((root / "conf/setup/optim/sgd.yaml").read_text())
    optim["optimizer"].update(setup.get("optim", {}).get("optimizer", {}))
    dataset = yaml.safe_load((root / "conf/setup/dataset/cifar10.yaml").read_text())
    dataset.update(setup.get("dataset", {}))
    hardware = yaml.safe_load((root / "conf/config.yaml").read_text())["hardware"]
    return {**setup, "network": network, "optim": optim, "dataset": dataset, "hardware": hardware}


def locate(root: Path, relpath: str, pattern: str) -> tuple[re.Match, str]:
    """The first line of a released file matching `pattern`, and its place as path:line."""
    path = root / relpath
    if not path.is_file():
        raise ReleasedCodeError(f"{path} missing: the checkout is not {RELEASED_REPO} at {RELEASED_COMMIT}")
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = re.search(pattern, line)
        if match:
            return match, f"{relpath}:{number}"
    raise ReleasedCodeError(f"{relpath}: no line matches {pattern!r}; the checkout is not the code this reads")
