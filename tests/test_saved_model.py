"""equiconvert.save / equiconvert.load: weights with their recipe, rebuilt to identical outputs; bad files refused."""
from __future__ import annotations

import pytest
import torch

import equiconvert
from equiconvert.recipe import recipe_of
from equiconvert.saved_model import FORMAT_VERSION, SavedModelError, library_versions, read


@pytest.fixture(scope="module")
def converted():
    torch.manual_seed(0)
    plain = equiconvert.create_model("resnet9", num_classes=3, in_channels=1, widths=(4, 8, 8))
    return equiconvert.make_equivariant(plain, "C4", width=0.5, input_size=16)


def test_save_then_load_gives_identical_outputs(converted, tmp_path):
    with torch.no_grad():
        next(p for p in converted.parameters()).add_(0.25)  # trained weights, not the initial ones
    path = equiconvert.save(converted, tmp_path / "model.pt")
    rng = torch.get_rng_state()
    loaded = equiconvert.load(path)
    assert torch.equal(torch.get_rng_state(), rng)  # rebuilding leaves the caller's RNG alone
    x = torch.randn(2, 1, 16, 16)
    converted.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), converted(x), rtol=0, atol=0)
    assert recipe_of(loaded) == recipe_of(converted)
    assert recipe_of(converted)["conversion"]["group"] == "C4" and recipe_of(converted)["model_kwargs"]["widths"]
    assert read(path)["versions"] == library_versions() and library_versions()["torch"] == torch.__version__


def test_model_without_recipe_needs_one(tmp_path):
    with pytest.raises(SavedModelError, match="pass recipe="):
        equiconvert.save(torch.nn.Linear(2, 2), tmp_path / "m.pt")


def test_corrupt_tampered_and_newer_files_are_refused(converted, tmp_path):
    path = equiconvert.save(converted, tmp_path / "model.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(SavedModelError, match="truncated.pt is not a readable equiconvert model file"):
        equiconvert.load(truncated)
    state = torch.load(path, weights_only=True)
    for name, change, match in (
            ("newer", {"format_version": FORMAT_VERSION + 1}, "upgrade equiconvert"),
            ("other", {"format": "something"}, "not an equiconvert model file"),
            ("no_weights", {"state_dict": None}, "lacks its recipe or its weights"),
            ("edited", {"state_dict": {k: v[..., :1] if v.dim() else v for k, v in state["state_dict"].items()}},
             "do not fit the network")):
        torch.save({**state, **change}, tmp_path / f"{name}.pt")
        with pytest.raises(SavedModelError, match=match):
            equiconvert.load(tmp_path / f"{name}.pt")
    code = tmp_path / "code.pt"
    torch.save({"format": "equiconvert-model", "payload": torch.nn.Linear(1, 1)}, code)  # a pickled object
    with pytest.raises(SavedModelError, match="not a readable"):
        equiconvert.load(code)
