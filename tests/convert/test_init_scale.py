"""A converted model starts at the original's signal scale, so the original's hyper-parameters train it.

Group pooling reduces a field to one invariant: a max over |G| channels or the norm of k
components grows with the field (the norm of 9 unit components is 3). unit_invariants scales
it back, so the classifier sees inputs, and gives logits, at about the original's scale.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from equiconvert import make_equivariant
from equiconvert.models.equivariant_resnet9 import equivariant_resnet9
from equiconvert.models.resnet9 import resnet9
from equiconvert.nn import GroupPool, InvariantMap
from equiconvert.nn.pooling import GROUP_POOL_MODES, unit_scale

LOGIT_STD_FACTOR = 1.6  # converted logits' std within this factor of the original's (before: 2.1x to 3.1x)
INIT_SEEDS = (0, 1, 2)  # one network's logits vary with its draw; their RMS over a few draws does less


def _logit_std(build, x: torch.Tensor) -> float:
    """The logits' std over the inputs and the INIT_SEEDS draws of `build()`."""
    variances = []
    for seed in INIT_SEEDS:
        torch.manual_seed(seed)
        with torch.no_grad():
            variances.append(float(build().eval()(x).var()))
    return math.sqrt(sum(variances) / len(variances))


@pytest.mark.parametrize("group", ["C8", "D4", "SO2", "O2"])
def test_converted_logits_start_at_the_original_scale(group):
    """Random inputs exaggerate what a max pool adds (on digits the converted std is 0.9x to 1.1x the original's)."""
    x = torch.randn(64, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    plain = lambda: resnet9(in_channels=1, widths=(8, 16, 32))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        original = _logit_std(plain, x)
        converted = _logit_std(lambda: make_equivariant(plain(), group, input_size=32), x)
    assert original / LOGIT_STD_FACTOR < converted < original * LOGIT_STD_FACTOR, (group, original, converted)


def test_unit_invariants_off_keeps_the_plain_reduction():
    plain = resnet9(in_channels=1, widths=(8, 16, 16))
    on = make_equivariant(plain, "O2", input_size=16)
    off = make_equivariant(plain, "O2", input_size=16, config={"unit_invariants": False})
    (scaled,) = [m for m in on.modules() if isinstance(m, InvariantMap)]
    (unscaled,) = [m for m in off.modules() if isinstance(m, InvariantMap)]
    assert scaled.scale == pytest.approx(scaled.field_size**-0.5) and unscaled.scale == 1.0


@pytest.mark.filterwarnings("ignore::equiconvert.convert.report.EquivarianceWarning")
def test_the_paper_preset_pools_unscaled():
    """The preset's numbers are a reproduction of the paper: its plain max over each field stays."""
    pools = [m for m in equivariant_resnet9("D4", in_channels=1).modules() if isinstance(m, GroupPool)]
    assert pools and all(p.scale == 1.0 for p in pools)


@pytest.mark.parametrize("mode", GROUP_POOL_MODES)
@pytest.mark.parametrize("field_size", [2, 8])
def test_unit_scale_gives_unit_rms_invariants(mode, field_size):
    pool = GroupPool(4096, field_size, mode, unit_scale(mode, field_size))
    out = pool(torch.randn(16, 4096 * field_size))
    assert float(out.pow(2).mean().sqrt()) == pytest.approx(1.0, abs=0.02)


def test_unit_scale_of_a_one_channel_field_is_exactly_one():
    """A trivial group's pooling is the identity: converting with C1 stays exact."""
    assert all(unit_scale(mode, 1) == 1.0 for mode in ("max", "norm"))


def test_norm_invariants_of_unit_fields_have_unit_rms():
    layer = InvariantMap(4096, 9, scale=unit_scale("norm", 9))
    assert float(layer(torch.randn(16, 4096 * 9)).pow(2).mean().sqrt()) == pytest.approx(1.0, abs=0.02)


@pytest.mark.parametrize("make", [lambda s: GroupPool(3, 8, "max", s), lambda s: InvariantMap(3, 8, scale=s)])
def test_the_scale_travels_with_the_state_dict(make):
    saved = make(0.25).state_dict()
    fresh = make(1.0)
    fresh.load_state_dict(saved)
    assert fresh.scale == 0.25


@pytest.mark.parametrize("make", [lambda s: GroupPool(3, 8, "max", s), lambda s: InvariantMap(3, 8, scale=s)])
def test_a_state_dict_without_the_scale_loads_unscaled(make):
    """Saved before invariant maps were scaled: the model it rebuilds computes what it was trained as."""
    layer = make(unit_scale("max", 8))
    layer.load_state_dict({}, strict=True)
    x = torch.randn(2, 24)
    assert layer.scale == 1.0 and torch.equal(layer(x), make(1.0)(x))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_a_non_positive_scale_is_refused(bad):
    with pytest.raises(ValueError, match="scale must be positive"):
        GroupPool(3, 8, "max", bad)
    with pytest.raises(ValueError, match="scale must be positive"):
        InvariantMap(3, 8, scale=bad)
