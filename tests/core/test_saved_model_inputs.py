"""equiconvert.save / load: a directory is refused before writing; unreadable files get one safe message."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import equiconvert
from equiconvert.saved_model import SavedModelError

SAFE = r"corrupt or not written by equiconvert\.save \(it is read with weights_only=True and never unpickled unsafely\)"


class _Code:
    def __reduce__(self):
        return (os.getcwd, ())


@pytest.fixture(scope="module")
def model():
    return equiconvert.create_model("resnet9", num_classes=2, widths=(2, 4, 4))


def test_save_to_a_directory_is_refused_and_leaves_nothing(model, tmp_path):
    target = tmp_path / "run"
    target.mkdir()
    with pytest.raises(SavedModelError, match=r"run: it is a directory; give a file path such as .*run/model.pt"):
        equiconvert.save(model, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"] and not any(target.iterdir())


def test_load_of_a_directory_names_it(tmp_path):
    with pytest.raises(SavedModelError, match=r"is a directory: give the path of the model file"):
        equiconvert.load(tmp_path)


@pytest.mark.parametrize("kind", ["random", "truncated", "empty", "pickle", "torch_code"])
def test_unreadable_files_never_suggest_unsafe_loading(model, tmp_path, kind):
    good = equiconvert.save(model, tmp_path / "model.pt").read_bytes()
    path = tmp_path / f"{kind}.pt"
    if kind == "pickle":
        path.write_bytes(pickle.dumps(_Code()))
    elif kind == "torch_code":
        torch.save({"recipe": _Code()}, path)
    else:
        path.write_bytes({"random": os.urandom(4000), "truncated": good[: len(good) // 2], "empty": b""}[kind])
    with pytest.raises(SavedModelError, match=rf"{kind}\.pt: {SAFE}; re-save it") as info:
        equiconvert.load(path)
    assert "weights_only` set to `False" not in str(info.value) and "Errno" not in str(info.value)
    assert info.value.__cause__ is not None  # torch's own error is kept as the cause
