"""The log of a DPTrainer run: its records in memory, and on rank 0 in out_dir/log.jsonl and a metrics logger.

A step's record may hold device tensors (batch size, training loss): they become numbers only when the log is
written, all at once, so the loop waits for the device at the steps that write and nowhere else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .callbacks import MetricsLogger, flat_metrics

INTEGER_FIELDS = ("batch_size", "nonfinite_gradients")  # record fields that are counts


class RunLog:
    """Records in order (`records`); `writes`: this process writes them (rank 0 of a job)."""

    def __init__(self, out_dir: Path | None, metrics_logger: MetricsLogger | None, writes: bool) -> None:
        self.out_dir, self.metrics_logger, self.writes = out_dir, metrics_logger, writes
        self.records: list[dict[str, Any]] = []
        self._written = 0  # records[:_written] are in the log

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
        if self.metrics_logger is not None and self.writes:
            for record in pending:
                if "step" in record and (values := flat_metrics(record)):
                    self.metrics_logger.log_metrics(values, int(record["step"]))
        if self.out_dir is not None and self.writes and pending:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "log.jsonl", "a") as handle:
                handle.writelines(json.dumps(record) + "\n" for record in pending)


def materialize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replace the tensors in `records` (in place) by numbers, copying them all to the host at once."""
    places = [(record, key) for record in records for key, value in record.items() if isinstance(value, torch.Tensor)]
    if places:
        values = torch.stack([record[key].detach().float().reshape(()) for record, key in places]).tolist()
        for (record, key), value in zip(places, values):
            record[key] = int(value) if key in INTEGER_FIELDS else value
    return records
