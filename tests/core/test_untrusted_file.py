"""Every reader of a file we did not write fails with our own error on any damaged or hostile bytes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import equiconvert
from equiconvert.errors import UnreadableFileError
from equiconvert.privacy import checkpoint
from equiconvert.privacy.checkpoint import CheckpointError
from equiconvert.saved_model import SavedModelError
from equiconvert.untrusted_file import load_weights_only

SEEDS = range(300)  # enough seeds that the unpickler's odd failures (IndexError, KeyError, ...) all occur


def _hostile_bytes(seed: int) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.getrandbits(8) for _ in range(rng.choice([1, 7, 64, 4000])))


def _causes(read, tmp_path: Path, expected: type[Exception]) -> set[str]:
    """The names of the unpickler's own failures behind `expected`, over all hostile files."""
    path = tmp_path / "hostile.pt"
    causes = set()
    for seed in SEEDS:
        path.write_bytes(_hostile_bytes(seed))
        with pytest.raises(expected) as info:
            read(path)
        assert info.value.__cause__ is not None, seed  # torch's failure is kept for debugging
        causes.add(type(info.value.__cause__).__name__)
    return causes


def test_any_failure_of_the_unpickler_becomes_one_error(tmp_path):
    causes = _causes(load_weights_only, tmp_path, UnreadableFileError)
    assert {"UnpicklingError", "IndexError", "KeyError"} <= causes  # not only the failures torch documents


def test_a_missing_file_stays_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_weights_only(tmp_path / "absent.pt")


def test_saved_model_load_never_leaks_the_unpicklers_error(tmp_path):
    assert len(_causes(equiconvert.load, tmp_path, SavedModelError)) > 1


def test_trainer_checkpoint_load_never_leaks_the_unpicklers_error(tmp_path):
    assert len(_causes(checkpoint.load, tmp_path, CheckpointError)) > 1


def test_privacy_engine_checkpoint_never_leaks_the_unpicklers_error(tmp_path):
    from equiconvert.privacy import PrivacyEngine

    model = torch.nn.Linear(2, 2)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2), torch.zeros(8).long()))
    private, _, _ = PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=data,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )

    def read(path: Path) -> None:
        PrivacyEngine().load_checkpoint(path=path, module=private)

    assert len(_causes(read, tmp_path, CheckpointError)) > 1
