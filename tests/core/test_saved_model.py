"""equiconvert.save / equiconvert.load: weights with their recipe, rebuilt to identical outputs; bad files refused."""

from __future__ import annotations

import pytest
import torch

import equiconvert
from equiconvert.build_recipe import recipe_of
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
    with pytest.raises(SavedModelError, match="truncated.pt: corrupt or not written by equiconvert.save"):
        equiconvert.load(truncated)
    state = torch.load(path, weights_only=True)
    for name, change, match in (
        ("newer", {"format_version": FORMAT_VERSION + 1}, "upgrade equiconvert"),
        ("other", {"format": "something"}, "not an equiconvert model file"),
        ("no_weights", {"state_dict": None}, "lacks its recipe or its weights"),
        (
            "edited",
            {"state_dict": {k: v[..., :1] if v.dim() else v for k, v in state["state_dict"].items()}},
            "do not fit the network",
        ),
    ):
        torch.save({**state, **change}, tmp_path / f"{name}.pt")
        with pytest.raises(SavedModelError, match=match):
            equiconvert.load(tmp_path / f"{name}.pt")
    code = tmp_path / "code.pt"
    torch.save({"format": "equiconvert-model", "payload": torch.nn.Linear(1, 1)}, code)  # a pickled object
    with pytest.raises(SavedModelError, match="corrupt or not written by equiconvert.save"):
        equiconvert.load(code)


def test_save_trained_writes_the_ema_weights(converted, tmp_path):
    from equiconvert.training.trainer import DPTrainer
    from equiconvert.saved_model import save_trained

    data = torch.rand(8, 1, 16, 16), torch.randint(0, 3, (8,))
    trainer = DPTrainer(
        converted,
        noise_multiplier=1.0,
        target_epsilon=None,
        batch_size=4,
        steps=2,
        aug_mult=1,
        ema_decay=0.5,
        progress=False,
        device="cpu",
    )
    trainer.fit(data)
    loaded = equiconvert.load(save_trained(trainer, tmp_path / "model.pt"))
    raw = dict(trainer.model.named_parameters())
    with trainer.ema.applied(trainer.model):
        averaged = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    assert any(not torch.equal(averaged[name], raw[name]) for name in raw)  # the EMA differs from the last step
    for name, value in loaded.named_parameters():
        assert torch.equal(value, averaged[name]), name


@pytest.mark.parametrize("group", ["C4", "none"])
def test_train_writes_a_loadable_model_and_the_versions(tmp_path, capsys, group):
    import json

    from equiconvert.cli import main
    from equiconvert.data import load_dataset
    from equiconvert.training.metrics import classification_metrics, predict
    from tests.support.train_args import tiny_train_args

    out = tmp_path / "run"
    args = tiny_train_args(out, model="equiconvert:resnet9", model_kwargs="widths=4,8,8", group=group, epsilon=8)
    assert main(args) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["versions"] == library_versions()
    model = equiconvert.load(out / "model.pt")
    assert isinstance(model, equiconvert.EquivariantModel) == (group != "none")
    test = load_dataset("synthetic", split="test")
    margin = (result["input_size"] - test.images.shape[-1]) // 2  # train pads symmetrically to a valid size
    images = torch.nn.functional.pad(test.images, (margin,) * 4)
    outputs = predict(model, images, 64, "cpu", lambda x: (x - result["normalize_mean"]) / result["normalize_std"])
    metrics = classification_metrics(outputs, test.labels)  # the file holds the weights the run scored
    assert metrics["loss"] == pytest.approx(result["test_loss"], rel=1e-5)
    assert metrics["accuracy"] == result["test_accuracy"]
