"""The output folder a run is given: an empty path or one that cannot be created is one line, never the current
folder filled silently or a raw OSError."""

from __future__ import annotations

import pytest
from torch import nn

from equiconvert.training.run_folder import OutputFolderError
from equiconvert.training.trainer import DPTrainer
from tests.support.cli_errors import run_error
from tests.support.train_args import tiny_train_args


def test_train_refuses_an_empty_out_and_writes_nothing_into_the_current_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    error = run_error(capsys, *tiny_train_args(""))  # type: ignore[arg-type]
    assert error.startswith("error: --out '': names no folder (an empty path is the current folder)")
    assert list(tmp_path.iterdir()) == []


def test_train_into_a_folder_that_cannot_be_created_is_one_line(capsys):
    error = run_error(capsys, *tiny_train_args("/proc/equiconvert-run"))  # type: ignore[arg-type]
    assert error == (
        "error: --out /proc/equiconvert-run cannot be created (No such file or directory): give a folder this user "
        "can write to"
    )


def test_a_trainer_refuses_an_empty_out_dir_before_any_data():
    with pytest.raises(OutputFolderError, match="out_dir='' names no folder .* or None to write nothing"):
        DPTrainer(nn.Linear(2, 2), out_dir="", progress=False)
