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
from equiconvert.recipes.build_model import activation_of, blocks_of, norm_groups_of
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
    paper = _spec("equiconvert:equivariant_resnet9", res2=False)
    assert (activation_of(paper), norm_groups_of(paper)) == ("mish", 8)
    assert blocks_of(paper) == {"res2": False, "pool_after_res2": False}
    other = _spec("equiconvert:resnet9")
    assert activation_of(other) is None and norm_groups_of(other) is None
    assert blocks_of(other) == {"res2": None, "pool_after_res2": None}
