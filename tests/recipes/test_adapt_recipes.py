"""[adapt] recipes: pretrained weights loaded whole, then trained as they are, canonicalised or carried; data.classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import equiconvert
from equiconvert.adapt import CanonicalizedModel
from equiconvert.cli import main
from equiconvert.data import load_dataset
from equiconvert.errors import ParameterError
from equiconvert.models import create_model
from equiconvert.recipes.adapt_model import adapt_model
from equiconvert.recipes.recipe import load_recipe, recipe_from_dict
from equiconvert.recipes.recipe_checks import check_recipe
from tests.support.train_args import tiny_train_args

ARMS = {  # shipped recipe -> (adapt.method, conversion.group)
    "fashion_split_c4_scratch_eps3": ("none", "C4"),
    "fashion_split_pretrained_eps3": ("none", "none"),
    "fashion_split_canonicalized_eps3": ("canonicalize", "C4"),
    "fashion_split_carried_eps3": ("carry_weights", "C4"),
}


def _weights(path: Path, seed: int = 0, **kwargs) -> dict[str, torch.Tensor]:
    """A small_cnn for the synthetic data (3 channels), its state dict saved to `path`."""
    torch.manual_seed(seed)
    state = create_model("small_cnn", in_channels=3, **kwargs).state_dict()
    torch.save(state, path)
    return state


def _recipe(tmp_path: Path, method: str, group: str, **adapt):
    return recipe_from_dict(
        {
            "model": {"name": "equiconvert:small_cnn"},
            "conversion": {"group": group},
            "adapt": {"method": method, **adapt},
            "data": {"dataset": "synthetic"},
            "dp": {"batch_size": 16, "aug_mult": 1},
            "schedule": {"steps": 1},
            "run": {"out": str(tmp_path / "run"), "device": "cpu"},
        }
    )


def test_the_shipped_adaptation_recipes_are_the_four_arms_on_the_same_private_data():
    for name, (method, group) in ARMS.items():
        recipe = load_recipe(name)
        assert (recipe.adapt.method, recipe.conversion.group) == (method, group), name
        assert recipe.model.name == "equiconvert:small_cnn" and recipe.data.classes == (5, 6, 7, 8, 9), name
        assert recipe.trainer.target_epsilon == 3.0 and recipe.trainer.steps == 600, name
        pretrained = method != "none" or group == "none"
        assert (recipe.adapt.weights == "pretrained/fashion_split_seed0.pt") == pretrained, name
    canonicalized = load_recipe("fashion_split_canonicalized_eps3").adapt
    assert canonicalized.public_classes == (0, 1, 2, 3, 4)  # the public classes alone teach the pose


@pytest.mark.parametrize("method, group", [("none", "none"), ("canonicalize", "C4"), ("carry_weights", "C4")])
def test_every_method_starts_from_the_weights_in_the_file(tmp_path, method, group):
    state = _weights(tmp_path / "w.pt")
    spec, config = check_recipe(_recipe(tmp_path, method, group, weights=str(tmp_path / "w.pt")))
    torch.manual_seed(123)  # another seed than the weights': nothing may come from a fresh initialisation
    adapted = adapt_model(spec, config, num_classes=10, channels=3, size=32, device="cpu")
    assert adapted.record["method"] == method and adapted.params_before == sum(v.numel() for v in state.values())
    if method == "carry_weights":  # the converted model computes the pretrained CNN's group average
        assert adapted.record["carry_logit_error"] < 0.05 * adapted.record["carry_logit_scale"]
        assert isinstance(adapted.model, equiconvert.EquivariantModel) and adapted.loss_fn is None
        return
    backbone = adapted.model.backbone if method == "canonicalize" else adapted.model
    assert all(torch.equal(backbone.state_dict()[name], value) for name, value in state.items())
    assert (adapted.loss_fn is not None) == (method == "canonicalize")  # pose_prior_loss


@pytest.mark.parametrize("method", ["canonicalize", "carry_weights"])
def test_an_adapted_run_trains_privately_saves_and_reloads_an_invariant_model(tmp_path, capsys, method):
    _weights(tmp_path / "w.pt")
    out = tmp_path / "run"
    args = tiny_train_args(out, model="equiconvert:small_cnn", group="C4", batch_size=16, physical_batch_size=16)
    adapt = [f"adapt.method={method}", f"adapt.weights={tmp_path / 'w.pt'}", "adapt.public_dataset=synthetic"]
    adapt += ["adapt.public_classes=[0, 1, 2, 3, 4]"] + (["adapt.pose_steps=2"] if method == "canonicalize" else [])
    assert main([*args, *(word for key in adapt for word in ("--set", key))]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["adaptation"]["method"] == method
    if method == "canonicalize":
        assert result["adaptation"] == {"method": "canonicalize", "prior_weight": 0.5, "pose_steps": 2}
    else:  # the logit error is measured on the public images: small against the logits
        assert result["adaptation"]["carry_logit_error"] < 0.05 * result["adaptation"]["carry_logit_scale"]
    assert result["max_equivariance_error"] <= 1e-5 and result["steps"] == 1 and 0 < result["epsilon"] <= 8
    loaded = equiconvert.load(out / "model.pt")  # both remember how they were built
    assert isinstance(loaded, CanonicalizedModel if method == "canonicalize" else equiconvert.EquivariantModel)
    check = equiconvert.check_equivariance(loaded, input_size=32, batch_size=2)
    assert check.max_error <= 1e-5
    capsys.readouterr()


def test_data_classes_keeps_only_those_labels_in_both_splits(tmp_path, capsys):
    out = tmp_path / "run"
    args = tiny_train_args(out, model="equiconvert:small_cnn", group="C4")
    pad = ["--set", "conversion.pad_to_valid=true"]  # 32x32 images; the converted CNN takes 1 mod 8: it pads them
    assert main([*args, "--set", "data.classes=[1, 3]", "--set", "conversion.head=invariant", *pad]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["input_size"] == 32 and result["max_equivariance_error"] <= 1e-5
    train, test = (load_dataset("synthetic", split=split).labels for split in ("train", "test"))
    assert result["train_examples"] == int(((train == 1) | (train == 3)).sum()) < len(train)
    assert result["test_examples"] == int(((test == 1) | (test == 3)).sum()) < len(test)
    capsys.readouterr()


def test_conversion_options_among_a_registry_models_keywords_reach_its_conversion(tmp_path):
    from equiconvert.build_recipe import recipe_of
    from equiconvert.recipes.build_model import build_model

    for unit_invariants in (True, False):
        recipe = _recipe(tmp_path, "none", "C4")
        recipe.model.kwargs = {"unit_invariants": unit_invariants}
        spec, _ = check_recipe(recipe)
        model, _ = build_model(spec, 10, 3)
        assert recipe_of(model)["conversion"]["config"] == {"unit_invariants": unit_invariants}


WEIGHTS = "WEIGHTS"  # stands for the file a case's test writes


@pytest.mark.parametrize(
    "method, group, adapt, message",
    [
        ("canonicalise", "C4", {"weights": WEIGHTS}, r"adapt.method='canonicalise': choose one of \['none', 'canon"),
        ("canonicalize", "C4", {}, r"give adapt.weights"),
        ("none", "C4", {"weights": WEIGHTS}, r"converting re-initialises every steerable layer"),
        ("canonicalize", "none", {"weights": WEIGHTS}, r"converting re-initialises every steerable layer"),
        ("canonicalize", "C4", {"weights": "missing.pt"}, r"adapt.weights=missing.pt: no such file"),
        ("canonicalize", "C4", {"weights": WEIGHTS, "pose_steps": -1}, r"adapt.pose_steps=-1: must be >= 0"),
        ("canonicalize", "C4", {"weights": WEIGHTS, "public_classes": [0]}, r"need adapt.public_dataset"),
        ("carry_weights", "C4", {"weights": WEIGHTS, "prior_weight": 2.0}, r"adapt.prior_weight=2.0: adapt.method="),
        ("none", "none", {"weights": WEIGHTS, "public_dataset": "synthetic"}, r"adapt.public_dataset='synthetic': "),
        ("none", "C4", {"pose_steps": 10}, r"adapt.pose_steps=10: adapt.method='none' does not read it"),
    ],
)
def test_a_bad_adaptation_is_refused_before_any_data_is_read(tmp_path, method, group, adapt, message):
    _weights(tmp_path / "w.pt")
    adapt = {key: str(tmp_path / "w.pt") if value == WEIGHTS else value for key, value in adapt.items()}
    with pytest.raises(ParameterError, match=message):
        check_recipe(_recipe(tmp_path, method, group, **adapt))


def test_conversion_options_are_refused_for_adapted_weights(tmp_path):
    _weights(tmp_path / "w.pt")
    recipe = _recipe(tmp_path, "carry_weights", "C4", weights=str(tmp_path / "w.pt"))
    recipe.conversion.width = 2.0
    with pytest.raises(ParameterError, match="conversion.width does not apply"):
        check_recipe(recipe)
    recipe = _recipe(tmp_path, "carry_weights", "C4", weights=str(tmp_path / "w.pt"))
    recipe.conversion.pad_to_valid = True
    with pytest.raises(ParameterError, match="conversion.pad_to_valid does not apply"):
        check_recipe(recipe)
    recipe = _recipe(tmp_path, "canonicalize", "C4", weights=str(tmp_path / "w.pt"))
    recipe.model.kwargs = {"unit_invariants": False}
    with pytest.raises(ParameterError, match=r"\['unit_invariants'\] are conversion options"):
        check_recipe(recipe)


def test_weights_that_do_not_fit_the_model_are_refused_naming_the_file_and_the_entries(tmp_path):
    _weights(tmp_path / "wide.pt", widths=(16, 32, 64, 128))
    spec, config = check_recipe(_recipe(tmp_path, "canonicalize", "C4", weights=str(tmp_path / "wide.pt")))
    with pytest.raises(
        ParameterError, match=r"(?s)wide.pt does not fit equiconvert:small_cnn .*size mismatch for features.9.weight"
    ):
        adapt_model(spec, config, num_classes=10, channels=3, size=32, device="cpu")
    torch.save({"not": "a state dict"}, tmp_path / "other.pt")
    spec, config = check_recipe(_recipe(tmp_path, "canonicalize", "C4", weights=str(tmp_path / "other.pt")))
    with pytest.raises(ParameterError, match=r"not a state dict"):
        adapt_model(spec, config, num_classes=10, channels=3, size=32, device="cpu")


def test_data_classes_outside_the_data_set_are_refused_by_key(tmp_path):
    from equiconvert.data import select_classes

    data = load_dataset("synthetic", split="test")
    with pytest.raises(ParameterError, match=r"data.classes=\[3, 10\]: give labels of synthetic in 0..9"):
        select_classes(data, (3, 10), "data.classes")
    assert select_classes(data, None, "data.classes") is data
