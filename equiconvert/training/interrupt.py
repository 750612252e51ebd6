"""Ctrl-C or SIGTERM during DPTrainer.fit: finish the step under way, write a checkpoint, and say how to resume.

A KeyboardInterrupt raised in the middle of a step could leave the weights updated but the step unrecorded by the
privacy ledger; so the first SIGINT (Ctrl-C) or SIGTERM (what schedulers and `kill` send) only asks the loop to stop
at the next step boundary, and a second one interrupts at once. In a job of several processes the launcher passes
the signal to every worker, and the ranks agree at each step boundary to stop together (DPTrainer). Only a run in
the main thread, with Python's own handler of the signal in place, defers it: a handler of the caller's is left
alone.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

# the signals that stop training at a step boundary -> how messages name them
STOP_SIGNALS: dict[signal.Signals, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
# Python's own handler of each: only a signal still handled so is deferred
_PYTHON_HANDLERS: dict[signal.Signals, Any] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGTERM: signal.SIG_DFL,
}


class TrainingInterrupted(KeyboardInterrupt):
    """fit stopped by a signal at a step boundary; `checkpoint` is the file written (None without out_dir), `signum`
    the signal (a command exits with 128 + signum, as shells report it)."""

    def __init__(self, step: int, checkpoint: Path | None, signum: signal.Signals = signal.SIGINT) -> None:
        self.step, self.checkpoint, self.signum = step, checkpoint, signum
        where = (
            f"its checkpoint is {checkpoint}: continue with fit(..., resume=True)"
            if checkpoint is not None
            else "no checkpoint was written (the trainer has no out_dir)"
        )
        super().__init__(f"training stopped by {STOP_SIGNALS[signum]} after step {step}; {where}")

    @property
    def signal_name(self) -> str:
        return STOP_SIGNALS[self.signum]


class DeferredInterrupt:
    """While active, the first SIGINT or SIGTERM sets `requested` to that signal (the loop stops at its next step
    boundary)."""

    def __init__(self) -> None:
        self.requested: signal.Signals | None = None
        self._installed: list[signal.Signals] = []

    def __enter__(self) -> "DeferredInterrupt":
        self.requested = None
        self._installed = []
        if threading.current_thread() is threading.main_thread():
            for signum, python_handler in _PYTHON_HANDLERS.items():
                if signal.getsignal(signum) is python_handler:
                    signal.signal(signum, self._handle)
                    self._installed.append(signum)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for signum in self._installed:
            signal.signal(signum, _PYTHON_HANDLERS[signum])
        self._installed = []

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:  # the second signal: at once
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum)
        print(
            f"\n{STOP_SIGNALS[self.requested]}: stopping after this step with a checkpoint (Ctrl-C again to abort now)",
            file=sys.stderr,
        )
