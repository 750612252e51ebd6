"""The device a run trains on, checked before any data is read: a mistyped or absent device is a clear error."""

from __future__ import annotations

import torch

_AVAILABLE = {
    "cpu": lambda: 1,
    "cuda": lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0,
    "mps": lambda: int(torch.backends.mps.is_available()),
}


def resolve_device(device: str | torch.device | None, flag: str = "device") -> torch.device:
    """`device` as a torch.device (None: cuda if available, else cpu); ValueError naming `flag` for a device this
    machine does not have or a name torch does not know."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{flag} {device}: not a device name ({', '.join(_AVAILABLE)}, or cuda:N)") from exc
    count = _AVAILABLE.get(resolved.type, lambda: 0)()
    if count == 0:
        raise ValueError(f"{flag} {device}: this machine has no {resolved.type} device; give {flag} cpu")
    if resolved.index is not None and resolved.index >= count:
        raise ValueError(f"{flag} {device}: this machine has {count} {resolved.type} device(s), cuda:0..{count - 1}")
    return resolved
