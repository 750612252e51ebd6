"""Workers of a multi-process job die with the process that started them.

torchrun starts its workers in sessions of their own, so a launcher killed with SIGKILL (which cannot forward
anything) would leave them training and writing into the output folder. Each worker asks Linux to send it SIGKILL
when its parent dies (prctl PR_SET_PDEATHSIG); `train --nproc-per-node` also tells its workers its pid, so a worker
whose launcher died before that request (while it was still importing) ends too.
"""

from __future__ import annotations

import ctypes
import os
import signal

LAUNCHER_PID = "EQUICONVERT_LAUNCHER_PID"  # set by distributed.launch for its workers
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def launcher_environment() -> dict[str, str]:
    """The environment entries a launcher gives its workers (this process is their launcher)."""
    return {LAUNCHER_PID: str(os.getpid())}


def die_with_parent() -> None:
    """From now on, this process is killed when its parent exits; at once if its launcher is already gone."""
    parent = int(os.environ.get(LAUNCHER_PID, os.getppid()))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request: nothing would signal this orphan
        os.kill(os.getpid(), signal.SIGKILL)
