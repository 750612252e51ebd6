"""The device a run trains on, checked before any data is read: a mistyped or absent device is a clear error."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..errors import ParameterError


def _device_count(kind: str) -> int | None:
    """How many `kind` devices this machine has, by torch's module of that name (torch.cuda, torch.xpu, torch.mps);
    None where torch has no such module to ask (the device is then taken as given)."""
    if kind == "cpu":
        return 1
    module = getattr(torch, kind, None)
    if module is None or not hasattr(module, "device_count"):
        return None
    available = getattr(module, "is_available", lambda: True)
    return int(module.device_count()) if available() else 0


def resolve_device(device: str | torch.device | None, name: str = "device") -> torch.device:
    """`device` as a torch.device (None: cuda if available, else cpu); ParameterError naming parameter `name` for a device this
    machine does not have or a name torch does not know."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ParameterError(f"{name}={device}: not a device name (cpu, cuda, cuda:N, mps, ...)") from exc
    count = _device_count(resolved.type)
    if count == 0:
        raise ParameterError(f"{name}={device}: this machine has no {resolved.type} device; give {name}=cpu")
    if count is not None and resolved.index is not None and resolved.index >= count:
        raise ParameterError(
            f"{name}={device}: this machine has {count} {resolved.type} device(s), "
            f"{resolved.type}:0..{resolved.type}:{count - 1}"
        )
    return resolved


@contextlib.contextmanager
def cudnn_autotuning(enabled: bool) -> Iterator[None]:
    """torch.backends.cudnn.benchmark on inside (when `enabled`), as it was afterwards: a run's choice does not
    outlive it."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = before or enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before
