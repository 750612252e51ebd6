"""One job per output folder: an exclusive lock on OUT/.equiconvert.lock while a run writes there.

Two jobs writing one folder would interleave their logs and overwrite each other's checkpoints. The lock is
fcntl.flock on a file in the folder: the operating system releases it when its holder exits, however it dies
(kill -9 included), so a dead job never keeps the folder. The file holds the holder's pid, for the message. Within
one process the lock is re-entrant (the command line's run holds it around the trainer, which takes it too).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from .run_folder import OutputFolderError, create_out

LOCK_FILE = ".equiconvert.lock"

_held: dict[Path, int] = {}  # folder (resolved) -> times this process holds its lock


class FolderInUseError(OutputFolderError):
    """Another live job holds the output folder's lock."""


@contextlib.contextmanager
def hold_run_folder(out: Path | None, create: bool = True) -> Iterator[None]:
    """Hold `out`'s lock for the block, or raise FolderInUseError naming the holder's pid.

    The folder is created unless `create` is False (a run to resume: a missing folder is the caller's error to
    report). None, a missing folder not to create, or a path that is a file (refused by the caller's own checks) is
    not locked."""
    if out is None or (out.exists() and not out.is_dir()) or not (create or out.is_dir()):
        yield
        return
    create_out(out)
    key = out.resolve()
    if key in _held:
        _held[key] += 1
        try:
            yield
        finally:
            _held[key] -= 1
        return
    try:
        fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        raise OutputFolderError(
            f"out={out} cannot be written ({error.strerror or error}): give a folder this user can write to"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderInUseError(
                f"{out} is in use by another training job (pid {_holder(fd)}): wait for it to end, stop it, "
                "or give another output folder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = 1
        try:
            yield
        finally:
            del _held[key]
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    """The pid the holder wrote into the lock file ("unknown" while it has not yet)."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"
