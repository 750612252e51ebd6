"""Ctrl-C during DPTrainer.fit: finish the step under way, write a checkpoint, and say how to resume.

A KeyboardInterrupt raised in the middle of a step could leave the weights updated but the step unrecorded by the
privacy ledger; so the first SIGINT only asks the loop to stop at the next step boundary, and a second one
interrupts at once. Only a single-process run in the main thread, with Python's own SIGINT handler in place,
defers: a job's ranks are stopped by their launcher, and a handler of the caller's is left alone.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType


class TrainingInterrupted(KeyboardInterrupt):
    """fit stopped by Ctrl-C at a step boundary; `checkpoint` is the file written (None without out_dir)."""

    def __init__(self, step: int, checkpoint: Path | None) -> None:
        self.step, self.checkpoint = step, checkpoint
        where = (
            f"its checkpoint is {checkpoint}: continue with fit(..., resume=True)"
            if checkpoint is not None
            else "no checkpoint was written (the trainer has no out_dir)"
        )
        super().__init__(f"training stopped by Ctrl-C after step {step}; {where}")


class DeferredInterrupt:
    """While active, the first SIGINT sets `requested` (the loop stops at its next step boundary)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.requested = False
        self._installed = False

    def __enter__(self) -> "DeferredInterrupt":
        self.requested = False
        self._installed = (
            self.enabled
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )
        if self._installed:
            signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # the second Ctrl-C: at once
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to abort now)", file=sys.stderr)
