"""Restriction to subgroups: a fixed permutation of the fields, exact equivariance to what remains."""
import pytest
import torch
import torchvision

import equiconvert
from equiconvert.check import act_on_output
from equiconvert.convert.fields import FieldType
from equiconvert.errors import GroupSpecError, UnsupportedLayerError
from equiconvert.groups import parse_group
from equiconvert.models import resnet9
from equiconvert.nn import FieldRestriction
from per_sample_check import assert_per_sample_gradients_match_loop


@pytest.mark.parametrize("group,step,sub", [("D8", "halved", "D4"), ("C8", "halved", "C4"), ("D4", "reflection", "D1"),
                                            ("D4", "invariant", "C1"), ("D8", "D2", "D2"), ("D4", "C4", "C4")])
def test_restricted_regular_field_transforms_as_subgroup_regular_fields(group, step, sub):
    """Restrict then act with h equals act with h (as an element of G) then restrict."""
    G = parse_group(group)
    H = G.subgroup(step)
    assert H.name == sub
    restriction = FieldRestriction(3, G.restriction_index(H))
    x = torch.randn(2, 3 * G.order, 5, 5)
    big = {(e.quarter_turns, e.flip): e for e in G.grid_elements}
    for h in H.grid_elements:
        g = big[(h.quarter_turns, h.flip)]
        lhs = restriction(act_on_output(g, x, FieldType(G, "regular", 3)))
        rhs = act_on_output(h, restriction(x), FieldType(H, "regular", 3 * G.order // H.order))
        assert torch.equal(lhs, rhs), h.name


@pytest.mark.parametrize("group,step", [("C4", "reflection"), ("D3", "halved"), ("D4", "D3"), ("C8", "D4")])
def test_impossible_restrictions_raise(group, step):
    with pytest.raises(GroupSpecError):
        parse_group(group).subgroup(step)


def _stage_outputs(model):
    """{restriction node: (its output type)} of a converted model."""
    return {n.name: n.meta["equiconvert_type"] for n in model.network.graph.nodes if "restrict" in n.name}


def test_schedule_d8_d4_d1_is_exactly_equivariant_to_d1_and_each_stage_transforms_as_typed():
    model = equiconvert.make_equivariant(resnet9(widths=(16, 32, 64)), "D8", head="invariant", restrict="D8->D4->D1",
                                         input_size=32).eval()
    stages = _stage_outputs(model)
    assert [t.group.name for t in stages.values()] == ["D4", "D1"]
    assert model.output_type.group.name == "D1"
    result = equiconvert.check_equivariance(model)
    assert set(result.errors) == {"rot0", "rot0+flip"}
    assert result.max_error < 1e-5, result.errors
    # every restricted stage's output transforms under its subgroup as its field type says
    x = torch.randn(2, 3, 32, 32)
    outputs = {}
    hooks = [getattr(model.network, n.target).register_forward_hook(
        lambda m, i, o, name=n.name: outputs.__setitem__(name, o))
        for n in model.network.graph.nodes if n.name in stages]
    with torch.no_grad():
        model(x)
        reference = dict(outputs)
        for name, ftype in stages.items():
            for h in ftype.group.grid_elements:
                model(h.act_on_grid(x))
                moved = act_on_output(h, reference[name], ftype)
                error = (outputs[name] - moved).abs().max() / moved.abs().max()
                assert error < 1e-5, (name, h.name, float(error))
    for hook in hooks:
        hook.remove()


def test_d8_d4_d1_equals_before_restriction_on_d8_fields():
    """The D8 part before the first restriction is D8-equivariant: rot45 is not on the grid, rot90 is."""
    model = equiconvert.make_equivariant(resnet9(widths=(16, 32, 64)), "D8", head="invariant", restrict=["D4", "D1"],
                                         input_size=32)
    names = [l.after for l in model.report.layers if l.before == "(inserted)" and "FieldRestriction" in l.after]
    assert len(names) == 2


def test_halved_restriction_on_torchvision_resnet18_sits_before_layer4():
    model = equiconvert.make_equivariant(torchvision.models.resnet18(num_classes=10), "D4", restrict="halved",
                                         input_size=33).eval()
    nodes = list(model.network.graph.nodes)
    point = next(n for n in nodes if "restrict" in n.name)
    assert {str(u.target) for u in point.users} >= {"layer4.0.conv1", "layer4.0.downsample.0"}
    result = equiconvert.check_equivariance(model)
    assert set(result.errors) == {"rot0", "rot180", "rot0+flip", "rot180+flip"}
    assert result.max_error < 1e-5


def test_dict_restriction_names_modules_and_unknown_names_raise():
    model = equiconvert.make_equivariant(resnet9(widths=(16, 32, 64)), "C8", head="invariant",
                                         restrict={"layer2": "halved", "layer3": "invariant"}, input_size=32)
    assert model.output_type.group.name == "C1"
    with pytest.raises(UnsupportedLayerError, match="nope"):
        equiconvert.make_equivariant(resnet9(widths=(16, 32, 64)), "C8", restrict={"nope": "halved"})
    with pytest.raises(GroupSpecError, match="start with"):
        equiconvert.make_equivariant(resnet9(widths=(16, 32, 64)), "C8", restrict="D8->D4")


def test_restricted_model_exports_exactly_with_torch_only_modules():
    model = equiconvert.make_equivariant(resnet9(widths=(16, 32, 64)), "D8", head="invariant", restrict="D8->D4->D1",
                                         input_size=32).eval()
    exported = equiconvert.export(model).eval()
    assert all(type(m).__module__.split(".")[0] in ("torch", "torchvision") for m in exported.modules())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(exported(x), model(x))


def test_per_sample_gradients_through_restriction_match_naive_loop():
    model = equiconvert.make_equivariant(resnet9(widths=(8, 16, 32)), "D4", head="invariant", restrict="halved",
                                         input_size=32).eval()
    assert_per_sample_gradients_match_loop(model, torch.randn(3, 3, 32, 32), torch.tensor([1, 4, 7]))


def test_default_placement_restricts_bottleneck_and_resnet_d_blocks_at_their_input():
    import timm

    for model, size in ((timm.create_model("resnet50d", num_classes=10), 65),
                        (torchvision.models.resnet50(num_classes=10), 33)):
        converted = equiconvert.make_equivariant(model, "C4", restrict="halved", head="invariant", input_size=size)
        point = next(n for n in converted.network.graph.nodes if "restrict" in n.name)
        assert {str(u.target) for u in point.users} >= {"layer4.0.conv1"}  # the block input, shortcut included
        result = equiconvert.check_equivariance(converted)
        assert set(result.errors) == {"rot0", "rot180"} and result.max_error < 1e-5


def test_restricting_one_branch_only_is_refused_naming_the_merge():
    with pytest.raises(UnsupportedLayerError, match=r"add.*combines field types .* of C2 and .* of C4|of C4 and .* of C2"):
        equiconvert.make_equivariant(torchvision.models.resnet18(num_classes=10), "C4",
                                     restrict={"layer4.0.bn1": "halved"}, input_size=33)
