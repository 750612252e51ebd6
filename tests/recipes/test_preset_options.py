"""The paper preset's options have one source (PresetOptions), which the runner and the model builders share."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from equiconvert.models.equivariant_resnet9 import (
    PRESET,
    PresetOptions,
    equivariant_resnet9,
    plain_paper_resnet9,
)
from equiconvert.models import create_model
from equiconvert.models._registry import ModelNameError, model_entry, preset_names, register_model
from equiconvert.recipes.build_model import blocks_of, head_of, preset_of
from equiconvert.recipes.run_spec import PRESET_KEYS, RunSpec


def _spec(model: str, **kwargs) -> RunSpec:
    return RunSpec(model=model, group="D4", dataset="synthetic", data_dir=None, out="x", model_kwargs=kwargs)


def test_the_preset_keys_are_the_options_fields() -> None:
    assert PRESET_KEYS == tuple(f.name for f in dataclasses.fields(PresetOptions))


def test_resolve_fills_in_the_preset_and_keeps_what_is_given() -> None:
    assert PresetOptions.resolve() == PRESET == PresetOptions("mish", 8, True, False)
    given = PresetOptions.resolve(activation="tanh", norm_groups=4, res2=False, pool_after_res2=True)
    assert given == PresetOptions("tanh", 4, False, True)
    with pytest.raises(ValueError, match="activation 'swish' is not one of"):
        PresetOptions.resolve(activation="swish")


def test_model_builders_default_to_the_preset() -> None:
    for builder in (plain_paper_resnet9, equivariant_resnet9):
        params = inspect.signature(builder).parameters
        assert params["act"].default == PRESET.activation
        for key in ("norm_groups", "res2", "pool_after_res2"):
            assert params[key].default == getattr(PRESET, key), (builder.__name__, key)


def test_runner_records_the_resolved_options() -> None:
    paper = preset_of(_spec("equivariant_resnet9", res2=False))
    assert (paper.activation, paper.norm_groups) == ("mish", 8)
    assert blocks_of(paper) == {"res2": False, "pool_after_res2": False}
    assert preset_of(_spec("equiconvert:resnet9")) is None and preset_of(_spec("torchvision:resnet18")) is None
    assert blocks_of(None) == {"res2": None, "pool_after_res2": None}


def test_the_registry_names_each_presets_baseline_options_and_head() -> None:
    entry = model_entry("equiconvert:equivariant_resnet9")
    assert (entry.baseline, entry.preset, entry.default_head) == ("plain_paper_resnet9", PresetOptions, "keep")
    assert preset_names() == ["equiconvert:equivariant_resnet9"]
    assert model_entry("torchvision:resnet18") is None and model_entry("resnet9").preset is None
    # the runner's head default comes from the factory's own: the preset's 2x2 grid, global pooling elsewhere
    assert head_of(_spec("equivariant_resnet9")) == "keep" and head_of(_spec("resnet9")) == "invariant"


def test_a_preset_must_name_both_its_baseline_and_its_options() -> None:
    for half in ({"baseline": "plain_paper_resnet9"}, {"preset": PresetOptions}):
        with pytest.raises(ModelNameError, match="names both baseline= and preset="):
            register_model(name="half_preset", equivariant=True, **half)(lambda group="C4": create_model("resnet9"))
