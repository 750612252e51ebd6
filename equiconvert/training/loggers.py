"""Where a run's log records go: a registry of loggers by name (jsonl, csv, tensorboard, wandb).

Every logger is fed by RunLog from the records log.jsonl gets, at the moment they are written, and nothing
else: whatever a logger shows is what the privacy guarantee (and the opt-ins log_step_times,
log_nonprivate_stats) lets log.jsonl hold. A logger that needs a package is refused by name before training
starts when the package is missing.
"""

from __future__ import annotations

import csv
import importlib
import importlib.util
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

from ..errors import ParameterTypeError, UsageError
from .callbacks import MetricsLogger, TensorBoardLogger, flat_fields, flat_metrics

JSONL = "jsonl"  # out_dir/log.jsonl: the run's own record, written whenever there is an out_dir
JSONL_FILE, CSV_FILE = "log.jsonl", "log.csv"
DEFAULT_LOGGERS: tuple[str, ...] = (JSONL,)
CSV_COLUMNS = ("line", "step", "key", "value")


class LoggerError(UsageError, ValueError):
    """A logger name that is unknown, or whose package is not installed."""


class RecordLogger:
    """A sink of the run's log records; `line` is the record's line in log.jsonl (0 first)."""

    def log_record(self, record: dict[str, Any], line: int) -> None:
        raise NotImplementedError

    def log_records(self, records: list[dict[str, Any]], first_line: int) -> None:
        """The records of one flush, the first at line `first_line` (file loggers open their file once)."""
        for line, record in enumerate(records, start=first_line):
            self.log_record(record, line)

    def resume(self, lines: int) -> None:
        """Drop what came from line `lines` on: a resumed run writes those steps again (a sink that cannot, keeps
        them)."""

    def close(self) -> None:
        """End of fit: release files and runs (a later record opens them again)."""


class FileLogger(RecordLogger):
    """A logger writing into one file, each flush's records in one open (subclasses write log_records)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def log_record(self, record: dict[str, Any], line: int) -> None:
        self.log_records([record], line)


class JsonlLogger(FileLogger):
    """One JSON object a line, the record as it is."""

    def log_records(self, records: list[dict[str, Any]], first_line: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in records)

    def resume(self, lines: int) -> None:
        if self.path.is_file():
            kept = self.path.read_text().splitlines(keepends=True)[:lines]
            self.path.write_text("".join(line if line.endswith("\n") else line + "\n" for line in kept))


class CsvLogger(FileLogger):
    """A long table, one row per field: line (of log.jsonl), step, key ("eval/accuracy" for nested fields) and
    value (text as it is, anything else as JSON), so records with different fields share one header."""

    def log_records(self, records: list[dict[str, Any]], first_line: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.is_file()
        with open(self.path, "a", newline="") as handle:
            writer = csv.writer(handle)
            if new:
                writer.writerow(CSV_COLUMNS)
            for line, record in enumerate(records, start=first_line):
                step = record.get("step", "")
                writer.writerows((line, step, key, csv_value(value)) for key, value in flat_fields(record).items())

    def resume(self, lines: int) -> None:
        if self.path.is_file():
            with open(self.path, newline="") as handle:
                rows = list(csv.reader(handle))
            kept = [rows[0], *(row for row in rows[1:] if int(row[0]) < lines)] if rows else []
            with open(self.path, "w", newline="") as handle:
                csv.writer(handle).writerows(kept)


def csv_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class MetricsAdapter(RecordLogger):
    """A MetricsLogger fed the numeric fields of each record that has a step; `owned`: built from a name, so
    closed at the end of fit (a logger object given by the caller stays the caller's to close)."""

    def __init__(self, logger: MetricsLogger, owned: bool = False) -> None:
        self.logger, self.owned = logger, owned

    def log_record(self, record: dict[str, Any], line: int) -> None:
        if "step" in record and (values := flat_metrics(record)):
            self.logger.log_metrics(values, int(record["step"]))

    def close(self) -> None:
        if self.owned:
            self.logger.close()  # type: ignore[attr-defined]


class WandbLogger:
    """MetricsLogger for Weights & Biases: a run under out_dir, offline unless WANDB_MODE says otherwise (an upload
    is the user's choice: `wandb login`, WANDB_MODE=online); project, entity and names come from the WANDB_*
    variables. The run starts at the first metrics and ends at close."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.run: Any = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.run is None:
            wandb = importlib.import_module("wandb")
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(dir=str(self.out_dir), mode=os.environ.get("WANDB_MODE", "offline"))
        self.run.log(metrics, step=step)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


@dataclass(frozen=True)
class LoggerEntry:
    """How a named logger is built from the run's out_dir, and the package it needs (None: none)."""

    make: Callable[[Path], RecordLogger]
    package: str | None = None


LOGGERS: dict[str, LoggerEntry] = {
    JSONL: LoggerEntry(lambda out: JsonlLogger(out / JSONL_FILE)),
    "csv": LoggerEntry(lambda out: CsvLogger(out / CSV_FILE)),
    "tensorboard": LoggerEntry(lambda out: MetricsAdapter(TensorBoardLogger(out / "tensorboard"), True), "tensorboard"),
    "wandb": LoggerEntry(lambda out: MetricsAdapter(WandbLogger(out), True), "wandb"),
}

LoggerSpec = Union[str, MetricsLogger, RecordLogger]


def list_loggers() -> list[str]:
    return sorted(LOGGERS)


def check_loggers(loggers: Sequence[LoggerSpec], parameter: str = "loggers") -> None:
    """Every name known and its package installed, every object a logger; errors name `parameter`."""
    if isinstance(loggers, str):
        raise LoggerError(f"{parameter} must be a list of logger names or objects, got the string {loggers!r}")
    for item in loggers:
        if isinstance(item, str):
            if item not in LOGGERS:
                raise LoggerError(f"{parameter}: unknown logger {item!r}; the loggers: {', '.join(list_loggers())}")
            package = LOGGERS[item].package
            if package is not None and importlib.util.find_spec(package) is None:
                raise LoggerError(f"{parameter}: the {item} logger needs the {package} package: pip install {package}")
        elif not isinstance(item, (RecordLogger, MetricsLogger)):
            raise ParameterTypeError(
                f"{parameter} takes logger names ({', '.join(list_loggers())}), RecordLogger objects or objects "
                f"with log_metrics(metrics, step); got {type(item).__name__}"
            )


def build_loggers(loggers: Sequence[LoggerSpec], out_dir: Path | None) -> list[RecordLogger]:
    """The record loggers of a run: log.jsonl first whenever there is an out_dir, each other name once, the
    objects as given (MetricsLoggers adapted). Names other than jsonl write into out_dir, so need one."""
    check_loggers(loggers)
    names = [JSONL] if out_dir is not None else []
    names += [item for item in dict.fromkeys(i for i in loggers if isinstance(i, str)) if item != JSONL]
    if out_dir is None and names:
        raise LoggerError(f"loggers {names} write into out_dir: give out_dir, or leave them out")
    built = [LOGGERS[name].make(out_dir) for name in names]  # type: ignore[arg-type]
    for item in loggers:
        if isinstance(item, RecordLogger):
            built.append(item)
        elif not isinstance(item, str):
            built.append(MetricsAdapter(item))
    return built
