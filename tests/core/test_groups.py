"""Group names, grid elements, and our pixel/channel action against escnn's own."""

import pytest
import torch

from equiconvert import GroupSpec, parse_group
from equiconvert.check import act_on_output
from equiconvert.convert.fields import FieldType
from equiconvert.errors import GroupSpecError


@pytest.mark.parametrize(
    "name,order,grid",
    [
        ("C1", 1, 1),
        ("C4", 4, 4),
        ("C8", 8, 4),
        ("C3", 3, 1),
        ("C16", 16, 4),
        ("D1", 2, 2),
        ("D4", 8, 8),
        ("D8", 16, 8),
        ("D3", 6, 2),
        ("d2", 4, 4),
    ],
)
def test_parse_and_grid_elements(name, order, grid):
    group = parse_group(name)
    assert group.order == order
    assert len(group.grid_elements) == grid
    assert group.grid_elements[0].name == "rot0"


@pytest.mark.parametrize("bad", ["C0", "D17", "SO2x", "X4", "", 4])
def test_bad_names_raise(bad):
    with pytest.raises(GroupSpecError, match="C1"):
        parse_group(bad)


def test_regular_permutations_form_a_representation():
    group = parse_group("D4")
    elements = {g.name: g for g in group.grid_elements}
    rot90 = torch.tensor(elements["rot90"].regular_perm)
    rot180 = torch.tensor(elements["rot180"].regular_perm)
    assert torch.equal(rot90[rot90], rot180)  # applying rot90 twice is rot180
    flip = torch.tensor(elements["rot0+flip"].regular_perm)
    assert torch.equal(flip[flip], torch.arange(8))


@pytest.mark.parametrize("name", ["C2", "C4", "C8", "D1", "D2", "D4", "D8"])
def test_action_matches_escnn(name):
    """Our rot90/flip + channel permutation equals escnn's GeometricTensor.transform."""
    from equiconvert._escnn_compat import import_escnn

    import_escnn()
    from escnn import nn as enn

    group = parse_group(name)
    gspace = group.escnn_gspace()
    fields = FieldType(group, "regular", 3)
    x = torch.randn(2, fields.channels, 5, 5)
    escnn_type = enn.FieldType(gspace, [gspace.regular_repr] * 3)

    def key(value):  # escnn: (flip, rotation) for D_N, rotation for C_N, flip alone for D1
        if isinstance(value, tuple):
            return int(value[0]), int(value[1])
        return (int(value), 0) if group.kind == "D" else (0, int(value))

    escnn_elements = {key(e.value): e for e in gspace.fibergroup.elements}
    for element_id, element in zip([g for g in group.elements if (4 * g[1]) % group.n == 0], group.grid_elements):
        theirs = enn.GeometricTensor(x, escnn_type).transform(escnn_elements[element_id]).tensor
        ours = act_on_output(element, x, fields)
        assert torch.allclose(ours, theirs, atol=1e-6), element.name


def test_group_spec_is_hashable_value():
    assert parse_group("D4") == GroupSpec("D", 4)
    assert len({parse_group("D4"), parse_group("d4")}) == 1
