"""Restriction to subgroups: a fixed permutation of the fields, exact equivariance to what remains."""

import pytest
import torch
import torchvision
from torchvision.models.resnet import Bottleneck, ResNet

import equiconvert
from equiconvert.check import act_on_output
from equiconvert.convert.fields import FieldType
from equiconvert.errors import GroupSpecError, UnsupportedLayerError
from equiconvert.groups import parse_group
from equiconvert.models import resnet9
from equiconvert.nn import FieldRestriction, ReflectionRestriction
from tests.support.per_sample_check import assert_per_sample_gradients_match_loop


@pytest.mark.parametrize(
    "group,step,sub",
    [
        ("D8", "halved", "D4"),
        ("C8", "halved", "C4"),
        ("D4", "reflection", "D1"),
        ("D4", "invariant", "C1"),
        ("D8", "D2", "D2"),
        ("D4", "C4", "C4"),
    ],
)
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
    model = equiconvert.make_equivariant(
        resnet9(widths=(16, 32, 64)), "D8", head="invariant", restrict="D8->D4->D1", input_size=32
    ).eval()
    stages = _stage_outputs(model)
    assert [t.group.name for t in stages.values()] == ["D4", "D1"]
    assert model.output_type.group.name == "D1"
    result = equiconvert.check_equivariance(model)
    assert set(result.errors) == {"rot0", "rot0+flip"}
    assert result.max_error < 1e-5, result.errors
    # every restricted stage's output transforms under its subgroup as its field type says
    x = torch.randn(2, 3, 32, 32)
    outputs = {}
    hooks = [
        getattr(model.network, n.target).register_forward_hook(
            lambda m, i, o, name=n.name: outputs.__setitem__(name, o)
        )
        for n in model.network.graph.nodes
        if n.name in stages
    ]
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
    model = equiconvert.make_equivariant(
        resnet9(widths=(16, 32, 64)), "D8", head="invariant", restrict=["D4", "D1"], input_size=32
    )
    names = [l.after for l in model.report.layers if l.before == "(inserted)" and "FieldRestriction" in l.after]
    assert len(names) == 2


def test_halved_restriction_on_torchvision_resnet18_sits_before_layer4():
    model = equiconvert.make_equivariant(
        torchvision.models.resnet18(num_classes=10), "D4", restrict="halved", input_size=33
    ).eval()
    nodes = list(model.network.graph.nodes)
    point = next(n for n in nodes if "restrict" in n.name)
    assert {str(u.target) for u in point.users} >= {"layer4.0.conv1", "layer4.0.downsample.0"}
    result = equiconvert.check_equivariance(model)
    assert set(result.errors) == {"rot0", "rot180", "rot0+flip", "rot180+flip"}
    assert result.max_error < 1e-5


def test_dict_restriction_names_modules_and_unknown_names_raise():
    model = equiconvert.make_equivariant(
        resnet9(widths=(16, 32, 64)),
        "C8",
        head="invariant",
        restrict={"layer2": "halved", "layer3": "invariant"},
        input_size=32,
    )
    assert model.output_type.group.name == "C1"
    with pytest.raises(UnsupportedLayerError, match="nope"):
        equiconvert.make_equivariant(resnet9(widths=(16, 32, 64)), "C8", restrict={"nope": "halved"})
    with pytest.raises(GroupSpecError, match="start with"):
        equiconvert.make_equivariant(resnet9(widths=(16, 32, 64)), "C8", restrict="D8->D4")


def test_restricted_model_exports_exactly_with_torch_only_modules():
    model = equiconvert.make_equivariant(
        resnet9(widths=(16, 32, 64)), "D8", head="invariant", restrict="D8->D4->D1", input_size=32
    ).eval()
    exported = equiconvert.export(model).eval()
    assert all(type(m).__module__.split(".")[0] in ("torch", "torchvision") for m in exported.modules())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(exported(x), model(x))


def test_per_sample_gradients_through_restriction_match_naive_loop():
    model = equiconvert.make_equivariant(
        resnet9(widths=(8, 16, 32)), "D4", head="invariant", restrict="halved", input_size=32
    ).eval()
    # float64: the bound tests the gradients' arithmetic, not float32 rounding (which varies with the CPU's kernels)
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    assert_per_sample_gradients_match_loop(model.double(), x, torch.tensor([1, 4, 7]), tolerance=1e-10)


def test_default_placement_restricts_bottleneck_and_resnet_d_blocks_at_their_input():
    import timm

    for model, size in (  # one block a stage: the blocks' structure is what places the restriction, not their count
        (timm.create_model("resnet50d", num_classes=10, layers=(1, 1, 1, 1)), 65),
        (ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10), 33),
    ):
        converted = equiconvert.make_equivariant(model, "C4", restrict="halved", head="invariant", input_size=size)
        point = next(n for n in converted.network.graph.nodes if "restrict" in n.name)
        assert {str(u.target) for u in point.users} >= {"layer4.0.conv1"}  # the block input, shortcut included
        result = equiconvert.check_equivariance(converted)
        assert set(result.errors) == {"rot0", "rot180"} and result.max_error < 1e-5


def test_restricting_one_branch_only_is_refused_naming_the_merge():
    with pytest.raises(
        UnsupportedLayerError, match=r"add.*combines field types .* of C2 and .* of C4|of C4 and .* of C2"
    ):
        equiconvert.make_equivariant(
            torchvision.models.resnet18(num_classes=10), "C4", restrict={"layer4.0.bn1": "halved"}, input_size=33
        )


# --- O(2) -> D1 ("reflection"): Hadamard pairs, see nn.restriction.ReflectionRestriction ---------


def _relative(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("frequency", [1, 2])
def test_o2_fields_restricted_to_reflections_transform_as_regular_d1_fields_bit_for_bit(frequency):
    G = parse_group("O2", frequency)
    H = G.subgroup("reflection")
    assert H.name == "D1" and G.subgroup("D1") == H
    pairs = G.reflection_pairs()
    assert len(pairs) == 2 + 4 * frequency  # 1 + 2L Hadamard pairs and 1 + 2L unpaired (gate) channels
    flip = G.field_matrix("field", 0.0, True).diagonal()
    assert all(flip[a] == 1 and (b is None or flip[b] == -1) for a, b in pairs)
    restriction = ReflectionRestriction(3, G.order, pairs)
    x = torch.randn(2, 3 * G.order, 5, 5)
    out_type = FieldType(H, "regular", 3 * len(pairs))
    for h, g in zip(H.grid_elements, G.grid_elements[::4]):  # rot0, rot0+flip
        assert (h.quarter_turns, h.flip) == (g.quarter_turns, g.flip)
        lhs = restriction(act_on_output(g, x, FieldType(G, "field", 3)))
        assert torch.equal(lhs, act_on_output(h, restriction(x), out_type)), h.name
    y = restriction(x)
    assert torch.allclose(y.pow(2).sum(1), x.pow(2).sum(1), rtol=1e-5)  # an isometry: nothing dropped
    assert torch.equal(restriction(x[..., 2, 3]), y[..., 2, 3])  # (B, C) vectors too


def _restricted_o2(name, frequency):
    if name == "resnet9":
        return equiconvert.make_equivariant(
            resnet9(widths=(16, 32, 64)),
            "O2",
            frequency=frequency,
            head="invariant",
            restrict="reflection",
            input_size=32,
        ).eval(), 32
    return equiconvert.make_equivariant(
        torchvision.models.resnet18(num_classes=10),
        "O2",
        frequency=frequency,
        head="invariant",
        restrict="reflection",
        input_size=33,
    ).eval(), 33


@pytest.mark.parametrize("frequency", [1, 2])
@pytest.mark.parametrize("name", ["resnet9", "resnet18"])
def test_o2_reflection_restriction_keeps_flip_invariant_logits_typed_stages_and_exact_export(name, frequency):
    torch.manual_seed(0)
    model, size = _restricted_o2(name, frequency)
    point = next(n for n in model.network.graph.nodes if "restrict" in n.name)
    assert isinstance(getattr(model.network, point.target), ReflectionRestriction)
    assert point.meta["equiconvert_type"].group.name == "D1" and model.output_type.group.name == "D1"
    result = equiconvert.check_equivariance(model)
    assert set(result.errors) == {"rot0", "rot0+flip"}
    # the restriction's output and the stage's last D1 feature map transform under the flip as their types say
    d1_maps = [
        n
        for n in model.network.graph.nodes
        if n.op == "call_module"
        and n.meta.get("equiconvert_type")
        and n.meta["equiconvert_type"].group.name == "D1"
        and n.meta["equiconvert_type"].spatial
        and not n.meta["equiconvert_type"].is_invariant
        and n.meta["equiconvert_shape"][-1] > 1
    ]
    watched = {n.target: n.meta["equiconvert_type"] for n in (point, d1_maps[-1])}
    outputs = {}
    hooks = [
        model.network.get_submodule(t).register_forward_hook(lambda m, i, o, t=t: outputs.__setitem__(t, o))
        for t in watched
    ]
    x = torch.randn(2, 3, size, size)
    flip = model.output_type.group.grid_elements[1]
    with torch.no_grad():
        logits = model(x)
        reference = dict(outputs)
        flipped = model(flip.act_on_grid(x))
        stage_errors = {
            t: _relative(outputs[t], act_on_output(flip, reference[t], ftype)) for t, ftype in watched.items()
        }
        exported = equiconvert.export(model).eval()
        same = torch.equal(exported(x), logits)
    for hook in hooks:
        hook.remove()
    print(
        f"O2 L={frequency} {name} restrict='reflection': logits under flip {result.errors['rot0+flip']:.2e}, "
        f"stages {stage_errors}, rot90 {_relative(model(torch.rot90(x, 1, (-2, -1))).detach(), logits):.2e}"
    )
    assert result.max_error <= 1e-5 and _relative(flipped, logits) <= 1e-5
    # the restriction itself is exact; what it receives carries the O(2) convs' float32 noise (about 1e-6, with the
    # CPU's kernels), deeper layers more
    assert stage_errors[point.target] <= 5e-6 and stage_errors[d1_maps[-1].target] <= 1e-5, stage_errors
    assert same and {type(m).__module__.split(".")[0] for m in exported.modules()} == {"torch"}


def test_per_sample_gradients_through_reflection_restriction_match_naive_loop():
    model = equiconvert.make_equivariant(
        resnet9(widths=(8, 16, 32)), "O2", head="invariant", restrict="reflection", input_size=32
    ).eval()
    assert any(isinstance(m, ReflectionRestriction) for m in model.modules())
    assert_per_sample_gradients_match_loop(model, torch.randn(3, 3, 32, 32), torch.tensor([1, 4, 7]))


def test_o2_schedules_and_reflection_without_reflections():
    model = equiconvert.make_equivariant(
        resnet9(widths=(8, 16, 32)), "O2", head="invariant", restrict="O2->D1->C1", input_size=32
    )
    assert [t.group.name for t in _stage_outputs(model).values()] == ["D1", "C1"]
    with pytest.raises(GroupSpecError, match="SO2 has none"):
        equiconvert.make_equivariant(resnet9(widths=(8, 16, 32)), "SO2", restrict="reflection", input_size=32)
    with pytest.raises(GroupSpecError, match="restrict only to 'invariant' or 'reflection'"):
        equiconvert.make_equivariant(resnet9(widths=(8, 16, 32)), "O2", restrict="halved", input_size=32)
