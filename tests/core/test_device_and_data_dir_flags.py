"""`train` checks --device and --data-dir before any data is read or model built."""

import pytest
import torch

from equiconvert.cli import main
from equiconvert.training import devices
from equiconvert.training.devices import resolve_device
from tests.support.train_args import tiny_train_args


def _cards(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_a_device_torch_does_not_know_is_refused_naming_the_flag(tmp_path, capsys):
    assert main(tiny_train_args(tmp_path / "o", device="tpu")) == 2
    assert "--device tpu: not a device name" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_device_this_machine_lacks_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    _cards(monkeypatch, 0)
    assert main(tiny_train_args(tmp_path / "o", device="cuda")) == 2
    assert "--device cuda: this machine has no cuda device; give --device cpu" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_resolve_device_counts_the_cards(monkeypatch):
    _cards(monkeypatch, 2)
    assert resolve_device(None) == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"device=cuda:5: this machine has 2 cuda device\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:5")
    _cards(monkeypatch, 0)
    assert resolve_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device=cuda: this machine has no cuda device"):
        resolve_device("cuda")


def test_a_device_torch_has_no_module_to_count_is_taken_as_given():
    assert devices._device_count("meta") is None and resolve_device("meta") == torch.device("meta")


def test_data_dir_for_the_generated_data_set_is_refused(tmp_path, capsys):
    assert main(tiny_train_args(tmp_path / "o", "--data-dir", str(tmp_path))) == 2
    assert "--data-dir" in (err := capsys.readouterr().err) and "synthetic data set is generated, not read" in err
