"""The logger registry: every logger gets exactly log.jsonl's records (private by default), CSV mirrors log.jsonl,
TensorBoard and W&B only when installed (refused early, by name, otherwise), and `train --logger`."""

from __future__ import annotations

import csv
import importlib.machinery
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from equiconvert.cli import main
from equiconvert.cli.train import train_recipe
from equiconvert.training import callbacks
from equiconvert.training.loggers import CsvLogger, JsonlLogger, LoggerError, RecordLogger, csv_value, flat_fields
from equiconvert.training.run_folder import OutputFolderError, prepare_out
from equiconvert.training.run_log import RunLog
from equiconvert.training.trainer import DPTrainer
from tests.support.tiny import linear_classifier, tiny_images
from tests.support.train_args import tiny_train_args

OPTIONS = dict(noise_multiplier=1.0, target_epsilon=None, batch_size=8, steps=4, aug_mult=1, ema_decay=None)
OPTIONS.update(augment_padding=0, augment_flip=False, progress=False, eval_every=2, epsilon_every=2)
SMALL_MODEL = dict(model="equiconvert:resnet9", model_kwargs="widths=4,8,8", group="none")  # for tiny_train_args()
NONPRIVATE_FIELDS = {"batch_size", "train_loss", "nonfinite_gradients"}  # per-step statistics of the secret batch


class Spy(RecordLogger):
    """An attacker's logger: keeps everything it is given."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, Any]]] = []
        self.closed = 0

    def log_record(self, record: dict[str, Any], line: int) -> None:
        self.records.append((line, json.loads(json.dumps(record))))

    def close(self) -> None:
        self.closed += 1


class MetricsSpy:
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((metrics, step))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _csv_records(path: Path) -> list[dict[str, str]]:
    """log.csv's rows grouped back into one {key: value text} per line of log.jsonl."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    grouped: dict[int, dict[str, str]] = {}
    for row in rows:
        grouped.setdefault(int(row["line"]), {})[row["key"]] = row["value"]
        assert row["step"] == str(grouped[int(row["line"])].get("step", row["step"]))
    assert list(grouped) == list(range(len(grouped)))
    return list(grouped.values())


def _as_csv(record: dict[str, Any]) -> dict[str, str]:
    return {key: csv_value(value) for key, value in flat_fields(record).items()}


def test_csv_logger_writes_exactly_the_keys_and_values_of_log_jsonl(tmp_path):
    images = tiny_images()
    trainer = DPTrainer(linear_classifier(), out_dir=tmp_path, loggers=["csv"], **OPTIONS)
    trainer.fit(images, eval_set=images)
    logged = _jsonl(tmp_path / "log.jsonl")
    assert len(logged) == 7 and any("eval" in r for r in logged) and "final_eval" in logged[-1]
    assert _csv_records(tmp_path / "log.csv") == [_as_csv(record) for record in logged]


def test_train_logger_flag_writes_log_csv_like_log_jsonl(tmp_path):
    out = tmp_path / "run"
    assert main(tiny_train_args(out, "--logger", "csv", **SMALL_MODEL)) == 0
    logged = _jsonl(out / "log.jsonl")
    assert logged and _csv_records(out / "log.csv") == [_as_csv(record) for record in logged]


def test_logger_flag_is_repeatable_and_comma_separated():
    from equiconvert.cli import _parser

    args = _parser().parse_args(["train", "--logger", "csv,jsonl", "--logger", "wandb"])
    assert train_recipe(args).run.loggers == ("csv", "jsonl", "wandb")
    assert train_recipe(_parser().parse_args(["train"])).run.loggers == ("jsonl",)


def test_no_logger_receives_per_step_batch_sizes_or_times_by_default(tmp_path):
    """The attack: a logger that keeps all it gets must not see the secret batch sizes, nor step times (which grow
    with them), nor anything log.jsonl does not hold."""
    images = tiny_images()
    spy, metrics = Spy(), MetricsSpy()
    DPTrainer(linear_classifier(), out_dir=tmp_path, loggers=["jsonl", spy, metrics], **OPTIONS).fit(images, images)
    assert [record for _, record in spy.records] == _jsonl(tmp_path / "log.jsonl")
    assert [line for line, _ in spy.records] == list(range(len(spy.records))) and spy.closed == 1
    seen = {key for _, record in spy.records for key in flat_fields(record)}
    seen |= {key for values, _ in metrics.calls for key in values}
    assert not seen & NONPRIVATE_FIELDS
    step_records = [r for _, r in spy.records if set(r) <= {"step", "lr", "epsilon", "time_s"} and "lr" in r]
    assert len(step_records) == OPTIONS["steps"] and not any("time_s" in r for r in step_records)
    assert len(metrics.calls) == len(spy.records) and not any("lr" in v and "time_s" in v for v, _ in metrics.calls)

    opted_in = Spy()  # the opt-ins are what lets them through: the same spy sees them then
    options = {**OPTIONS, "log_nonprivate_stats": True, "log_step_times": True}
    with pytest.warns(UserWarning, match="NOT covered"):
        trainer = DPTrainer(linear_classifier(), out_dir=tmp_path / "opt-in", loggers=[opted_in], **options)
    trainer.fit(images)
    assert all({"batch_size", "time_s"} <= set(r) for _, r in opted_in.records if "lr" in r)


def test_resume_cuts_the_same_lines_from_log_jsonl_and_log_csv(tmp_path):
    log = RunLog(tmp_path, [JsonlLogger(tmp_path / "log.jsonl"), CsvLogger(tmp_path / "log.csv")], writes=True)
    records = [{"step": 1, "lr": 0.5}, {"step": 2, "eval": {"accuracy": 0.25}}, {"step": 3, "lr": 0.5}]
    for record in records:
        log.append(dict(record))
    log.resume(2)
    assert _jsonl(tmp_path / "log.jsonl") == records[:2]
    assert _csv_records(tmp_path / "log.csv") == [_as_csv(r) for r in records[:2]]


def test_log_csv_is_a_run_record_that_overwrite_removes(tmp_path):
    (tmp_path / "log.csv").write_text("line,step,key,value\n0,1,step,1\n")
    with pytest.raises(OutputFolderError, match=r"holds an earlier run \(log.csv\)"):
        prepare_out(tmp_path, resume=False, overwrite=False)
    prepare_out(tmp_path, resume=False, overwrite=True)
    assert not (tmp_path / "log.csv").exists()


def test_unknown_logger_names_the_known_ones_and_names_need_out_dir(tmp_path):
    with pytest.raises(LoggerError, match=r"^loggers: unknown logger 'mlflow'; the loggers: csv, jsonl, tensorboard"):
        DPTrainer(linear_classifier(), out_dir=tmp_path, loggers=["mlflow"], **OPTIONS)
    with pytest.raises(LoggerError, match=r"loggers \['csv'\] write into out_dir"):
        DPTrainer(linear_classifier(), loggers=["csv"], **OPTIONS)
    with pytest.raises(LoggerError, match="must be a list"):
        DPTrainer(linear_classifier(), out_dir=tmp_path, loggers="csv", **OPTIONS)
    with pytest.raises(TypeError, match="loggers takes logger names"):
        DPTrainer(linear_classifier(), out_dir=tmp_path, loggers=[print], **OPTIONS)
    DPTrainer(linear_classifier(), **OPTIONS).fit(tiny_images())  # no out_dir: the default jsonl writes nothing


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_logger_without_its_package_is_refused_before_training(tmp_path, monkeypatch, capsys, name):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else real_find_spec(n, *a))
    with pytest.raises(LoggerError, match=f"^loggers: the {name} logger needs the {name} package: pip install {name}$"):
        DPTrainer(linear_classifier(), out_dir=tmp_path / "run", loggers=[name], **OPTIONS)
    assert not (tmp_path / "run").exists()
    assert main(tiny_train_args(tmp_path / "cli", "--logger", f"csv,{name}", **SMALL_MODEL)) == 2
    error = capsys.readouterr().err
    assert error == f"error: --logger: the {name} logger needs the {name} package: pip install {name}\n"
    assert not (tmp_path / "cli").exists()


def _fake_module(monkeypatch, name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_wandb_logger_runs_offline_under_out_unless_wandb_mode_says_otherwise(tmp_path, monkeypatch):
    runs: list[dict[str, Any]] = []

    class Run:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs, self.logged, self.finished = kwargs, [], False
            runs.append(self.__dict__)

        def log(self, metrics: dict[str, float], step: int) -> None:
            self.logged.append((step, metrics))

        def finish(self) -> None:
            self.finished = True

    _fake_module(monkeypatch, "wandb", init=lambda **kwargs: Run(**kwargs))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    DPTrainer(linear_classifier(), out_dir=tmp_path / "a", loggers=["wandb"], **OPTIONS).fit(tiny_images())
    (run,) = runs
    assert run["kwargs"] == {"dir": str(tmp_path / "a"), "mode": "offline"} and run["finished"]
    assert [step for step, _ in run["logged"]] == [1, 2, 3, 4, 4]
    assert all(not set(metrics) & NONPRIVATE_FIELDS and "time_s" not in metrics for _, metrics in run["logged"][:4])
    monkeypatch.setenv("WANDB_MODE", "online")
    DPTrainer(linear_classifier(), out_dir=tmp_path / "b", loggers=["wandb"], **OPTIONS).fit(tiny_images())
    assert runs[1]["kwargs"]["mode"] == "online"


def _fake_tensorboard(monkeypatch) -> list[Any]:
    """torch.utils.tensorboard's SummaryWriter as a fake that keeps its scalars; returns the writers made."""
    writers: list[Any] = []

    class SummaryWriter:
        def __init__(self, log_dir: str) -> None:
            self.log_dir, self.scalars, self.walltimes, self.closed = log_dir, [], [], False
            writers.append(self)

        def add_scalar(self, name: str, value: float, step: int, walltime: float | None = None) -> None:
            self.scalars.append((name, value, step))
            self.walltimes.append((step, walltime))

        def flush(self) -> None:
            pass

        def close(self) -> None:
            self.closed = True

    _fake_module(monkeypatch, "tensorboard")
    _fake_module(monkeypatch, "torch.utils.tensorboard", SummaryWriter=SummaryWriter)
    monkeypatch.setattr(callbacks, "tensorboard_available", lambda: True)
    return writers


def test_tensorboard_logger_writes_scalars_under_out_and_closes(tmp_path, monkeypatch):
    writers = _fake_tensorboard(monkeypatch)
    DPTrainer(linear_classifier(), out_dir=tmp_path, loggers=["tensorboard"], **OPTIONS).fit(tiny_images())
    (writer,) = writers
    assert writer.log_dir == str(tmp_path / "tensorboard") and writer.closed
    assert {name for name, _, _ in writer.scalars} == {"lr", "epsilon", "time_s"}
    assert all(step == 4 for name, _, step in writer.scalars if name == "time_s")  # the final record's only


def test_attack_tensorboard_wall_times_do_not_time_the_steps(tmp_path, monkeypatch):
    """The attack: with a record every step, the writer's own wall-clock stamp of each event times each step (which
    follows its secret batch size). Every event is stamped by its step instead, one second a step from a fixed
    origin, so the differences between stamps are the step counts and nothing else."""
    writers = _fake_tensorboard(monkeypatch)
    options = {**OPTIONS, "epsilon_every": 1}
    DPTrainer(linear_classifier(), out_dir=tmp_path, loggers=["tensorboard"], **options).fit(tiny_images())
    (writer,) = writers
    assert len({step for step, _ in writer.walltimes}) == OPTIONS["steps"]
    assert all(walltime is not None for _, walltime in writer.walltimes)
    assert len({walltime - step for step, walltime in writer.walltimes}) == 1  # origin + step, for every event
