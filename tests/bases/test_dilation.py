"""Dilated convolutions use the dense k x k basis on their dilated grid: exact, escnn-free, platform independent."""

import math
import sys

import pytest
import torch
from torch import nn

import equiconvert
from equiconvert.bases.canonical import BasisMismatchError, canonical_basis, orthonormal_span
from equiconvert.nn.reexpress import reexpress_state_dict
from equiconvert.basis import steerable_basis, symmetrize_on_grid
from equiconvert.groups import parse_group
from equiconvert.nn.conv import SteerableConv2d


def _net(dilation: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=dilation, dilation=dilation),
        nn.ReLU(),
        nn.Conv2d(8, 8, 5, padding=2 * dilation, dilation=dilation),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def _convs(model: nn.Module) -> list[SteerableConv2d]:
    return [m for m in model.modules() if isinstance(m, SteerableConv2d)]


@pytest.mark.parametrize("group", ["C4", "D4", "O2"])
def test_dilated_convs_use_the_undilated_basis_tensor(group):
    dilated = equiconvert.make_equivariant(_net(2), group, input_size=17, config={"basis_cutoff": 3.0})
    dense = equiconvert.make_equivariant(_net(1), group, input_size=17, config={"basis_cutoff": 3.0})
    pairs = list(zip(_convs(dilated), _convs(dense), strict=True))
    assert [c.dilation for c, _ in pairs] == [2, 2, 1]
    for conv, reference in pairs:
        assert torch.equal(conv.basis, reference.basis)
        assert conv.basis_fingerprint == reference.basis_fingerprint  # the tensor is the same: so is its fingerprint


@pytest.mark.parametrize("group", ["C4", "D4"])
def test_model_with_dilated_convs_is_exactly_invariant_in_float64(group):
    model = equiconvert.make_equivariant(_net(2), group, input_size=17).double()
    result = equiconvert.check_equivariance(model)
    assert len(result.errors) == (4 if group == "C4" else 8)
    assert result.max_error < 1e-12, result.errors
    output = model.eval()(torch.randn(2, 3, 17, 17, dtype=torch.float64))
    assert output.abs().max() > 1e-3  # not trivially invariant (a zero output would be)


def test_dilated_bases_build_without_escnn(cold_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "escnn", None)  # any import of escnn now fails
    model = equiconvert.make_equivariant(_net(2), "D4", input_size=17)
    assert [c.dilation for c in _convs(model)] == [2, 2, 1]
    # one cache entry per (group, fields, kernel size): the dilation does not change the tensor
    names = sorted(p.name for p in cold_cache.rglob("*.pt"))
    assert names == ["D4_regular_regular_k3.pt", "D4_regular_regular_k5.pt", "D4_trivial_regular_k3.pt"], names


def _escnn_dilated_basis(group, in_repr, out_repr, k, cutoff):
    """The basis equiconvert gave dilation-2 convs before: escnn's dilated span, canonical, symmetrised on the grid."""
    from equiconvert.bases.escnn_reference import escnn_basis

    return symmetrize_on_grid(
        canonical_basis(escnn_basis(group, in_repr, out_repr, k, 2, cutoff)), group, in_repr, out_repr
    )


def test_checkpoint_with_escnn_dilated_bases_is_refused_then_reexpressed():
    group = parse_group("D4")
    old_basis = _escnn_dilated_basis(group, "regular", "regular", 3, 3.0)
    new_basis = steerable_basis(group, "regular", "regular", 3, cutoff=3.0)
    assert old_basis.shape[0] == 72 and new_basis.shape[0] == 64  # escnn's dilated span holds 8 aliased directions
    torch.manual_seed(1)
    old = nn.Sequential(SteerableConv2d(old_basis, 2, 3, padding=2, dilation=2))
    new = nn.Sequential(SteerableConv2d(new_basis, 2, 3, padding=2, dilation=2))
    with pytest.raises(BasisMismatchError, match=r"^0: .*reexpress_state_dict"):
        new.load_state_dict(old.state_dict())

    new.load_state_dict(reexpress_state_dict(new, old.state_dict(), {"0": old_basis}))
    # least squares in filter space: the new filters are the old ones projected onto the new span
    span = orthonormal_span(new_basis)  # (out * in * k * k, 64), one field pair
    old_blocks = old[0].expand_filter().detach().double().unflatten(0, (3, 8)).unflatten(2, (2, 8))
    old_blocks = old_blocks.permute(0, 2, 1, 3, 4, 5).reshape(6, -1)
    projected = (old_blocks @ span) @ span.T
    new_blocks = new[0].expand_filter().detach().double().unflatten(0, (3, 8)).unflatten(2, (2, 8))
    new_blocks = new_blocks.permute(0, 2, 1, 3, 4, 5).reshape(6, -1)
    assert torch.allclose(new_blocks, projected, atol=1e-5)
    # not exact: the aliased directions have no counterpart in the new basis
    assert (old_blocks - projected).norm() > 0.01 * old_blocks.norm()


def relation_to_escnn(name: str, k: int, cutoff: float | None) -> dict[str, float]:
    """How escnn's dilation-2 span relates to equiconvert's basis for dilated convs (hidden -> hidden fields)."""
    from equiconvert.bases.escnn_reference import escnn_basis

    kind, _, frequency = name.partition(":")
    group = parse_group(kind, int(frequency) if frequency else None)
    hidden = group.hidden_repr
    ours = orthonormal_span(steerable_basis(group, hidden, hidden, k, cutoff=cutoff))
    escnn = escnn_basis(group, hidden, hidden, k, 2, cutoff).double().flatten(1)
    theirs = orthonormal_span(escnn)
    values = torch.linalg.svdvals(escnn)
    cosines = torch.linalg.svdvals(ours.T @ theirs).clamp(max=1.0)
    off_ours = escnn - (escnn @ ours) @ ours.T
    return {
        "ours": ours.shape[1],
        "escnn_elements": escnn.shape[0],
        "escnn_rank": theirs.shape[1],
        "escnn_condition": float(values[-1] / values[0]),
        "equal_angles": int((cosines > 1 - 1e-6).sum()),
        "largest_angle_deg": math.degrees(math.acos(float(cosines.min()))),
        "escnn_off_ours": float(off_ours.norm() / escnn.norm()),
        "ours_off_escnn": float((ours - theirs @ (theirs.T @ ours)).norm(dim=0).max()),
    }


# docs/bases.md, "Dilated kernels" (cutoff 3): (ours, escnn elements, escnn rank, largest angle, escnn off ours)
DOCUMENTED = [
    ("C4", 3, (32, 52, 36, 0.0, 0.20)),
    ("D4", 3, (64, 104, 72, 0.0, 0.20)),
    ("C8", 3, (64, 104, 72, 23.6, 0.46)),
    ("O2:2", 3, (166, 170, 170, 23.6, 0.39)),
]


@pytest.mark.parametrize("name,k,expected", DOCUMENTED)
def test_relation_to_escnns_dilated_span_is_as_documented(name, k, expected):
    from equiconvert._escnn_compat import import_escnn

    import_escnn()  # the extra is what this compares with (installed by the set-up)
    found = relation_to_escnn(name, k, 3.0)
    ours, elements, rank, angle, off_ours = expected
    assert (found["ours"], found["escnn_elements"], found["escnn_rank"]) == (ours, elements, rank), found
    assert abs(found["largest_angle_deg"] - angle) < 0.1, found
    assert abs(found["escnn_off_ours"] - off_ours) < 0.005, found
