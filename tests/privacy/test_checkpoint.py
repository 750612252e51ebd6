"""Checkpoints and output folders: safe loading, clear errors, one run per --out, crash leftovers."""

from __future__ import annotations

import errno
import io
import json
import os
import pathlib
import re
import stat
from pathlib import Path

import pytest
import torch

from equiconvert.cli import main
from equiconvert.privacy import checkpoint
from equiconvert.errors import RunError
from equiconvert.privacy.checkpoint import CheckpointError, CheckpointWriteError, load, save_atomic
from equiconvert.training.trainer import DPTrainer
from tests.support.cli_errors import run_error
from tests.support.paths import REPO_ROOT
from tests.support.tiny import linear_classifier, tiny_images
from tests.support.train_args import tiny_train_args

OPTIONS = dict(
    noise_multiplier=1.0,
    target_epsilon=None,
    batch_size=8,
    steps=2,
    aug_mult=1,
    lr=1.0,
    ema_decay=None,
    augment_padding=0,
    augment_flip=False,
    progress=False,
    checkpoint_every=1,
)
MODEL = dict(model="equiconvert:resnet9", model_kwargs="widths=4,8,8", group="none")  # for tiny_train_args()


class _Payload:
    """Unpickling this creates a file: what a crafted checkpoint could do with weights_only=False."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_crafted_checkpoint_does_not_execute_code(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"step": _Payload(marker)}, tmp_path / "checkpoint.pt")
    trainer = DPTrainer(linear_classifier(), out_dir=tmp_path, **OPTIONS)
    with pytest.raises(CheckpointError, match="cannot be read safely"):
        trainer.fit(tiny_images(), resume=True)
    assert not marker.exists()


def test_every_file_read_uses_weights_only():
    sources = [*(REPO_ROOT / "equiconvert").rglob("*.py"), *(REPO_ROOT / "benchmarks").rglob("*.py")]
    loads = [(path, line) for path in sources for line in path.read_text().splitlines() if "torch.load(" in line]
    assert loads, "no torch.load found: the scan is broken"
    unsafe = [
        f"{path.relative_to(REPO_ROOT)}: {line.strip()}" for path, line in loads if "weights_only=True" not in line
    ]
    assert not unsafe, unsafe


@pytest.mark.parametrize(
    "content", [b"", b"PK\x03\x04 truncated", b"not a checkpoint at all"], ids=["empty", "truncated", "corrupt"]
)
def test_bad_checkpoint_is_one_clear_line(tmp_path, capsys, content):
    out = tmp_path / "run"
    assert main(tiny_train_args(out, **MODEL)) == 0
    (out / "checkpoint.pt").write_bytes(content)
    capsys.readouterr()
    error = run_error(capsys, *tiny_train_args(out, "--resume", steps=2, **MODEL), code=3)  # a data error
    assert str(out / "checkpoint.pt") in error and re.search("empty|cannot be read safely", error)


def test_truncated_real_checkpoint_is_refused(tmp_path):
    DPTrainer(linear_classifier(), out_dir=tmp_path, **OPTIONS).fit(tiny_images())
    data = (tmp_path / "checkpoint.pt").read_bytes()
    (tmp_path / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated, corrupt"):
        load(tmp_path / "checkpoint.pt")


def test_non_empty_out_needs_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_train_args(out, **MODEL)) == 0
    first_log = (out / "log.jsonl").read_text()
    capsys.readouterr()
    error = run_error(capsys, *tiny_train_args(out, **MODEL))
    assert "is not empty" in error and "--resume" in error and "--overwrite" in error
    assert (out / "log.jsonl").read_text() == first_log  # untouched
    assert main(tiny_train_args(out, "--overwrite", **MODEL)) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "lr" in r] == [1]  # the new run's log only, not appended
    assert len(json.loads((out / "result.json").read_text())["evals"]) == 0


def test_resume_without_a_checkpoint_is_an_error(tmp_path, capsys):
    error = run_error(capsys, *tiny_train_args(tmp_path / "fresh", "--resume", **MODEL))
    assert "--resume: there is no checkpoint" in error
    with pytest.raises(CheckpointError, match="nothing to resume"):
        DPTrainer(linear_classifier(), out_dir=tmp_path / "api", **OPTIONS).fit(tiny_images(), resume=True)


def test_stray_temporary_file_is_removed_on_the_next_start(tmp_path):
    stray = tmp_path / ".checkpoint.pt.k1ll3d.tmp"
    stray.write_bytes(b"half a checkpoint")
    unrelated = tmp_path / "notes.tmp"
    unrelated.write_text("kept")
    DPTrainer(linear_classifier(), out_dir=tmp_path, **OPTIONS).fit(tiny_images())
    assert not stray.exists() and unrelated.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == ["notes.tmp"]


def test_save_fsyncs_the_folder_after_the_rename(tmp_path, monkeypatch):
    synced: list[tuple[bool, bool]] = []  # (a folder?, the checkpoint in place yet?)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), (tmp_path / "c.pt").exists()))
        real_fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    save_atomic({"x": torch.ones(2)}, tmp_path / "c.pt")
    assert synced == [(False, False), (True, True)]
    assert stat.S_IMODE((tmp_path / "c.pt").stat().st_mode) == 0o600


class _DiskFullAfter(io.RawIOBase):
    """A file that takes `room` bytes, then fails every write with ENOSPC, as a full disk does."""

    def __init__(self, handle: io.RawIOBase, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.handle.write(data)

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.handle.fileno()

    def close(self) -> None:
        self.handle.close()
        super().close()


def test_a_full_disk_during_a_save_keeps_the_last_good_checkpoint_and_is_one_line(tmp_path, monkeypatch):
    """torch.save used to fail with its own RuntimeError ("unexpected pos ...") that named no cause."""
    path = tmp_path / "checkpoint.pt"
    save_atomic({"step": 1, "w": torch.ones(4)}, path)
    real_fdopen = os.fdopen
    monkeypatch.setattr(
        checkpoint.os, "fdopen", lambda *args, **kwargs: _DiskFullAfter(real_fdopen(*args, **kwargs), 600)
    )
    with pytest.raises(CheckpointWriteError) as caught:
        save_atomic({"step": 2, "w": torch.zeros(1000)}, path)
    message = str(caught.value)
    assert message == (
        f"checkpoint {path} could not be written (No space left on device); the last good checkpoint there is kept: "
        "free space on its file system (or give another out=) and resume"
    )
    assert isinstance(caught.value, RunError) and "\n" not in message
    monkeypatch.undo()
    kept = load(path)
    assert kept["step"] == 1 and torch.equal(kept["w"], torch.ones(4))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left behind
