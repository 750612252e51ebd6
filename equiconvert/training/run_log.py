"""The log of a DPTrainer run: its records in memory, and on rank 0 in out_dir/log.jsonl and the other loggers.

A step's record may hold device tensors (batch size, training loss): they become numbers only when the log is
written, all at once, so the loop waits for the device at the steps that write and nowhere else.

A resumed run continues the log of its checkpoint: lines written after the checkpoint (by a run killed
later) are dropped, so each step has one record, and RunClock's time goes on from the checkpoint's.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .loggers import RecordLogger

INTEGER_FIELDS = ("batch_size", "nonfinite_gradients")  # record fields that are counts
STEP_TIMES_WARNING = (
    "log_step_times: each step's record carries its wall time, which grows with the step's secret Poisson batch "
    "size; these times are NOT covered by the differential privacy guarantee"
)


def warn_step_times(stacklevel: int = 3) -> None:
    """The warning a run that logs each step's time gives once."""
    warnings.warn(STEP_TIMES_WARNING, stacklevel=stacklevel)


class RunLog:
    """Records in order (`records`); `writes`: this process writes them (rank 0 of a job), to `loggers`
    (loggers.py: log.jsonl and the others, each fed these records and nothing else)."""

    def __init__(self, out_dir: Path | None, loggers: list[RecordLogger], writes: bool) -> None:
        self.out_dir, self.writes = out_dir, writes
        self.loggers = loggers
        self.records: list[dict[str, Any]] = []
        self._written = 0  # records[:_written] are in the log
        self.lines = 0  # lines of log.jsonl this run's log goes on from (a checkpoint stores it)

    def append(self, record: dict[str, Any], defer: bool = False) -> None:
        """Append `record`; unless deferred, write every record not yet written (rank 0 only)."""
        self.records.append(record)
        if not defer:
            self.flush()

    def flush(self) -> None:
        """Turn the device tensors of the unwritten records into numbers (one wait) and write them to the log."""
        pending = self.records[self._written :]
        materialize(pending)
        self._written = len(self.records)
        for logger in self.loggers:
            logger.log_records(pending, self.lines)
        if self.out_dir is not None and self.writes:
            self.lines += len(pending)

    def close(self) -> None:
        """End of fit: the loggers release their files and runs."""
        for logger in self.loggers:
            logger.close()

    def resume(self, lines: int | None) -> None:
        """Go on from a checkpoint that stored `lines` lines of the log (None: one that did not count them):
        later lines, records of steps the resumed run takes again, are cut from the loggers' files (rank 0)."""
        if lines is None or self.out_dir is None:
            return
        self.lines = lines
        for logger in self.loggers:
            logger.resume(lines)


class RunClock:
    """A run's wall time across resumes: the checkpoint's (`before`) plus this process's since `start()`."""

    def __init__(self) -> None:
        self.before = 0.0
        self._started: float | None = None

    def start(self) -> None:
        self._started = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds the run has trained, the stopped runs it resumes included."""
        running = time.perf_counter() - self._started if self._started is not None else 0.0
        return self.before + running


def materialize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replace the tensors in `records` (in place) by numbers, copying them all to the host at once."""
    places = [(record, key) for record in records for key, value in record.items() if isinstance(value, torch.Tensor)]
    if places:
        values = torch.stack([record[key].detach().float().reshape(()) for record, key in places]).tolist()
        for (record, key), value in zip(places, values):
            record[key] = int(value) if key in INTEGER_FIELDS else value
    return records
