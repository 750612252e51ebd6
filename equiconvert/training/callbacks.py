"""Hooks into DPTrainer's loop and a metrics-logger interface (TensorBoard when it is installed; loggers.py
builds loggers by name).

Records given to `on_step_end` may hold device tensors (the loop does not wait for the device at every
step); a MetricsLogger receives plain numbers, when the trainer writes its log.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class Callback:
    """Override the hooks you need; the trainer (a DPTrainer) calls them on rank 0 and every other rank alike."""

    def on_step_end(self, trainer: Any, record: dict[str, Any]) -> None:
        """After each logical step; `record` is that step's log record."""

    def on_eval_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        """After each evaluation during or at the end of fit."""


@runtime_checkable
class MetricsLogger(Protocol):
    """Anything with log_metrics (a TensorBoard writer adapter, an experiment tracker's client, a test fake)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...


def flat_fields(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every field of a log record, nested ones as "eval/accuracy"."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(flat_fields(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def flat_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a log record, nested ones as "eval/accuracy"; "step" and text fields left out."""
    return {
        key: float(value)
        for key, value in flat_fields(record).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key.rpartition("/")[2] != "step"
    }


class TensorBoardLogger:
    """MetricsLogger writing TensorBoard scalars under log_dir (needs the tensorboard package); the event file
    opens at the first metrics and closes at close().

    Each scalar is stamped with a synthetic wall time, the logger's creation (before training) plus one second a
    step: the writer's own stamps, the moment each record is written, would time the steps, whose durations
    follow the secret Poisson batch sizes. Real times are in the records (`time_s`) where the run logs them.
    """

    def __init__(self, log_dir: str | Path) -> None:
        if not tensorboard_available():
            raise ImportError("TensorBoardLogger needs the tensorboard package: pip install tensorboard")
        self.log_dir = Path(log_dir)
        self.writer: Any = None
        self.origin = float(int(time.time()))  # whole seconds, before the first step

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.log_dir))
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step, walltime=self.origin + step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None
