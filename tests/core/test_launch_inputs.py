"""`train --nproc-per-node N` refuses more workers than the run's device offers, before starting any."""

from __future__ import annotations

import os

import pytest
import torch

from equiconvert.cli import main
from equiconvert.training import distributed
from tests.support.train_args import tiny_train_args


@pytest.fixture
def launched(monkeypatch):
    """The worker counts that reached the launcher (which starts nothing here)."""
    calls: list[int] = []
    monkeypatch.setattr(distributed, "launch", lambda n, module, argv, log_dir: calls.append(n))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one visible card
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    return calls


@pytest.mark.parametrize(
    "device,workers,message",
    [
        ("cpu", 3, "--nproc-per-node 3: only 2 CPU cores are available"),
        ("cuda", 2, "--nproc-per-node 2: only 1 CUDA devices are visible"),
    ],
)
def test_more_workers_than_devices_are_refused(tmp_path, capsys, launched, device, workers, message):
    code = main(tiny_train_args(tmp_path / "run", nproc_per_node=workers, device=device))
    assert code != 0 and launched == []
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_workers_within_the_count_are_launched(tmp_path, launched):
    assert main(tiny_train_args(tmp_path / "run", nproc_per_node=2, device="cpu")) == 0
    assert launched == [2]
