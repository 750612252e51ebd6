"""Atomic, owner-only checkpoints, read back without executing anything.

A checkpoint holds intermediate models and the secret generator states of the
noise and the sampling (secure_rng): it is as secret as the training data, so it
is written with permissions 0o600. A crash while writing never destroys the last
good one, and a failed write (a full disk) keeps it too; the temporary file a killed save leaves behind
is removed on the next start (`remove_stale_temporaries`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..errors import DataError, RunError, UnreadableFileError
from ..untrusted_file import load_weights_only

OWNER_ONLY = 0o600
_TMP_SUFFIX = ".tmp"


class CheckpointError(DataError, ValueError):
    """A checkpoint file is empty, truncated, corrupt or not an equiconvert checkpoint."""


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}."


class CheckpointWriteError(RunError, OSError):
    """A checkpoint could not be written (a full disk, a quota, an I/O error); the last good one is kept."""


def save_atomic(state: dict[str, Any], path: str | Path) -> None:
    """Write to an owner-only temporary file in the same folder, fsync, rename over `path`, fsync the folder.

    A failed write (a full disk) removes the temporary file, leaves the last good checkpoint at `path` as it was
    and raises CheckpointWriteError."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temporary_prefix(path), suffix=_TMP_SUFFIX)
    try:
        os.fchmod(fd, OWNER_ONLY)
        with os.fdopen(fd, "wb", buffering=0) as handle:  # unbuffered: closing it after a failed write writes nothing
            writer = _FailedWriteRecorder(handle)
            try:
                torch.save(state, writer)
                handle.flush()
                os.fsync(handle.fileno())
            except (OSError, RuntimeError) as error:
                # torch reports a failed write as a RuntimeError of its own ("unexpected pos ..."): its cause is kept
                cause = error if isinstance(error, OSError) else writer.error
                if cause is None:
                    raise
                kept = "the last good checkpoint there is kept" if path.exists() else "no checkpoint was written yet"
                raise CheckpointWriteError(
                    f"checkpoint {path} could not be written ({cause.strerror or cause}); {kept}: free space on its "
                    "file system (or give another out=) and resume"
                ) from cause
        os.replace(tmp, path)
        _fsync_directory(path.parent)  # the rename itself survives a power loss
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class _FailedWriteRecorder:
    """The file torch.save writes through, keeping the OSError of a failed write, which torch itself drops."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.handle.flush()


def _fsync_directory(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Delete the temporary files that killed saves of `path` left behind; returns what was removed."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    stale = sorted(path.parent.glob(f"{_temporary_prefix(path)}*{_TMP_SUFFIX}"))
    for leftover in stale:
        leftover.unlink()
    return stale


def load(path: str | Path) -> dict[str, Any]:
    """The checkpoint at `path`, loaded with weights_only=True (a crafted file cannot run code)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"checkpoint {path} is empty (a save was interrupted?): delete it and start again, or give another out="
        )
    try:
        state = load_weights_only(path, map_location="cpu")
    except UnreadableFileError as error:
        # torch's own text can suggest weights_only=False, which would run the file's code: keep it as the cause only
        raise CheckpointError(
            f"checkpoint {path} cannot be read safely ({type(error.__cause__).__name__}): it is truncated, corrupt "
            "or not an equiconvert checkpoint; delete it and start again, or give another out="
        ) from error.__cause__
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not an equiconvert checkpoint")
    return state
