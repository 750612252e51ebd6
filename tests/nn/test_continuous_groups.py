"""SO(2)/O(2): gated irrep fields, their layers, conversions, export and per-sample gradients."""

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import equiconvert
from equiconvert.check import act_on_output
from equiconvert.convert.fields import FieldType
from equiconvert.errors import GroupSpecError
from equiconvert.groups import ContinuousGroupSpec, parse_group
from equiconvert.models import equivariant_resnet9, resnet9
from equiconvert.models.equivariant_resnet9 import TABLE1_PARAMS
from equiconvert.nn import GatedNonlinearity, GroupStandardization, InvariantMap, NormMaxPool2d, SteerableConv2d
from tests.support.per_sample_check import assert_per_sample_gradients_match_loop

GROUPS = [("SO2", 1), ("SO2", 2), ("O2", 1), ("O2", 2)]


def _relative(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("name,frequency", GROUPS)
def test_field_matrices_match_escnn_and_form_a_representation(name, frequency):
    from equiconvert._escnn_compat import import_escnn

    import_escnn()
    group = parse_group(name, frequency)
    escnn_field = group.escnn_repr("field")
    fibre = group.escnn_gspace().fibergroup
    for element in group.grid_elements:
        angle = element.quarter_turns * torch.pi / 2
        theirs = escnn_field(fibre.element((int(element.flip), angle)) if name == "O2" else fibre.element(angle))
        assert torch.allclose(group.grid_matrix("field", element), torch.tensor(theirs), atol=1e-12), element.name
    rot90 = group.grid_matrix("field", group.grid_elements[1])
    assert torch.equal(rot90 @ rot90, group.grid_matrix("field", group.grid_elements[2]))


def test_parse_continuous_groups():
    assert parse_group("O2") == ContinuousGroupSpec("O2", 1)
    assert parse_group("so(2)", frequency=3).layout.size == 1 + 3 + 6
    assert parse_group("O2", 1).layout.size == 9  # trivial + sign + 2 psi_1 (induced) + 3 gates
    assert len(parse_group("O2").grid_elements) == 8 and len(parse_group("SO2").grid_elements) == 4


def _layers(group, fields=5):
    layout = group.layout
    norm = GroupStandardization(fields, layout, 2, affine=True)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    return [
        GatedNonlinearity(fields, layout, nn.Mish()),
        norm,
        GroupStandardization(fields, layout, 3),
        NormMaxPool2d(fields, layout, 2),
        NormMaxPool2d(fields, layout, 3, 2, 1),
        InvariantMap(fields, layout.size),
    ]


@pytest.mark.parametrize("name,frequency", GROUPS)
def test_irrep_field_layers_are_equivariant(name, frequency):
    group = parse_group(name, frequency)
    fields = FieldType(group, "field", 5)
    for layer in _layers(group):
        size = 8 if isinstance(layer, NormMaxPool2d) and layer.kernel_size == 2 else 9  # symmetric windows only
        x = torch.randn(2, fields.channels, size, size)
        out_type = FieldType(group, "trivial", 5) if isinstance(layer, InvariantMap) else fields
        with torch.no_grad():
            y = layer(x)
            for g in group.grid_elements:
                error = _relative(layer(act_on_output(g, x, fields)), act_on_output(g, y, out_type))
                assert error < 1e-5, (type(layer).__name__, g.name, error)


def test_group_standardization_centres_only_trivial_channels_and_shares_one_scale():
    group = parse_group("O2")
    layout = group.layout
    norm = GroupStandardization(4, layout, 2)
    x = torch.randn(3, 4 * layout.size, 6, 6) + 5.0  # an offset on every channel, rotating ones included
    y = norm(x).reshape(3, 2, 2, layout.size, 36)
    trivial = y[:, :, :, : layout.trivial]
    assert trivial.mean((2, 3, 4)).abs().max() < 1e-5  # one mean per (sample, group), removed from trivial channels
    assert y.pow(2).mean((2, 3, 4)).sub(1).abs().max() < 1e-3  # one std per (sample, group), over every channel
    ratio = y[:, :, :, layout.trivial :] / x.reshape(3, 2, 2, layout.size, 36)[:, :, :, layout.trivial :]
    assert torch.allclose(ratio, ratio[..., :1, :1].expand_as(ratio), rtol=1e-4)  # rotating: scaled only


def test_gated_nonlinearity_gates_each_component_with_its_own_invariant():
    group = parse_group("SO2", 2)
    layer = GatedNonlinearity(1, group.layout, nn.ReLU())
    x = torch.tensor([[-1.0, 0.0, 100.0, 3.0, 4.0, 1.0, 1.0]])[..., None, None]
    y = layer(x).flatten()
    assert y[0] == 0 and y[1] == 0 and y[2] == 100  # trivial channels: ReLU
    assert torch.allclose(y[3:5], torch.tensor([1.5, 2.0]))  # sigmoid(0) = 1/2
    assert torch.allclose(y[5:], torch.ones(2))  # sigmoid(100) = 1


def _assert_invariant_logits(model, name):
    result = equiconvert.check_equivariance(model, batch_size=2)
    expected = {"rot0", "rot90", "rot180", "rot270"} | (
        {"rot0+flip", "rot90+flip", "rot180+flip", "rot270+flip"} if name == "O2" else set()
    )
    assert set(result.errors) == expected
    assert result.max_error <= 1e-5, result.errors
    return result


ANGLES = (15.0, 30.0, 45.0)
# Measured on random (untrained) networks with a disk-masked white-noise input: 0.05-0.18 for
# SO(2)/O(2) resnet9 and resnet18, against 0.39-0.44 for the unconstrained (C1) resnet9. The error
# off the grid comes from bilinear resampling of the input (white noise loses ~half its energy at
# high frequencies) and from 3x3 filters, which can only be band-limited, not exactly rotated.
ANGLE_BOUND = 0.3


@pytest.mark.parametrize("name,frequency", [("O2", 1), ("O2", 2), ("SO2", 1)])
def test_resnet9_converts_with_invariant_logits_and_bounded_angle_error(name, frequency):
    model = equiconvert.make_equivariant(
        resnet9(widths=(16, 32, 64)), name, frequency=frequency, head="invariant", input_size=32
    ).eval()
    assert model.report.invariant_output
    _assert_invariant_logits(model, name)
    result = equiconvert.check_equivariance(model, angles=ANGLES, batch_size=4)
    print(f"{name} L={frequency} resnet9 angle errors: {result.angle_errors}")
    assert max(result.angle_errors.values()) < ANGLE_BOUND


@pytest.mark.parametrize("name,frequency", [("O2", 1), ("O2", 2), ("SO2", 1)])
def test_resnet18_converts_with_invariant_logits_and_bounded_angle_error(name, frequency):
    model = equiconvert.make_equivariant(
        torchvision.models.resnet18(num_classes=10), name, frequency=frequency, head="invariant", input_size=33
    ).eval()
    assert any(isinstance(m, NormMaxPool2d) for m in model.modules())  # the stem max pool
    _assert_invariant_logits(model, name)
    result = equiconvert.check_equivariance(model, angles=ANGLES, batch_size=2)
    print(f"{name} L={frequency} resnet18 angle errors: {result.angle_errors}")
    assert max(result.angle_errors.values()) < ANGLE_BOUND


def test_continuous_models_beat_the_unconstrained_network_off_the_grid():
    errors = {}
    for name in ("O2", "C1"):
        torch.manual_seed(0)
        model = equiconvert.make_equivariant(resnet9(widths=(16, 32, 64)), name, head="invariant", input_size=32)
        errors[name] = max(equiconvert.check_equivariance(model, angles=ANGLES, batch_size=4).angle_errors.values())
    print(errors)
    assert errors["O2"] < 0.6 * errors["C1"]


def test_o2_preset_parameter_count_within_5_percent_of_table1():
    model = equivariant_resnet9("O2")
    count = sum(p.numel() for p in model.parameters())
    print(f"O2: {count:,} parameters (Table 1: ~{TABLE1_PARAMS['O2']:,})")
    assert abs(count - TABLE1_PARAMS["O2"]) <= 0.05 * TABLE1_PARAMS["O2"]


def test_bias_only_on_trivial_channels():
    model = equivariant_resnet9("O2", layout=(8, 16, 16))  # the paper's convs have a bias
    conv = next(m for m in model.modules() if isinstance(m, SteerableConv2d))
    with torch.no_grad():
        conv.bias.normal_()
    bias = conv.expand_bias().reshape(conv.out_fields, conv.out_size)
    trivial = parse_group("O2").layout.trivial
    assert bias[:, trivial:].abs().max() == 0 and bias[:, :trivial].abs().min() > 0


def test_restriction_to_invariant_and_unsupported_restrictions():
    model = equiconvert.make_equivariant(
        resnet9(widths=(8, 16, 32)), "O2", head="invariant", restrict="invariant", input_size=32
    )
    assert model.output_type.group.name == "C1"
    with pytest.raises(GroupSpecError, match="restrict only to 'invariant', not 'halved'"):
        equiconvert.make_equivariant(resnet9(widths=(8, 16, 32)), "SO2", restrict="halved", input_size=32)


def _small_o2_model(**kwargs):
    """The paper's block (conv with bias and weight standardization -> gate -> group standardization -> pool)."""
    return equivariant_resnet9("O2", layout=(8, 16, 16), head="invariant", input_size=16, **kwargs).eval()


def test_export_of_o2_model_is_exact_and_torch_only():
    for model in (_small_o2_model(), equivariant_resnet9("O2").eval(), _small_o2_model(restrict="invariant")):
        exported = equiconvert.export(model).eval()
        assert {type(m).__module__.split(".")[0] for m in exported.modules()} == {"torch"}
        x = torch.randn(2, 3, model.default_input_size(), model.default_input_size())
        with torch.no_grad():
            assert torch.equal(exported(x), model(x))


def test_per_sample_gradients_through_every_irrep_layer_match_naive_loop():
    model = _small_o2_model()
    kinds = {type(m) for m in model.modules()}
    assert {GatedNonlinearity, GroupStandardization, NormMaxPool2d, InvariantMap, SteerableConv2d} <= kinds
    with torch.no_grad():  # make the (otherwise zero) biases matter
        for m in model.modules():
            if isinstance(m, SteerableConv2d) and m.bias is not None:
                m.bias.normal_(0, 0.1)
    # float64: in float32 the two orders of summation already differ by ~1e-5 relative, so 1e-6 in float64
    # is the test that would catch a wrong gradient and not rounding
    assert_per_sample_gradients_match_loop(
        model.double(), torch.randn(3, 3, 16, 16, dtype=torch.float64), torch.tensor([1, 4, 7]), tolerance=1e-6
    )


class _Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.fc = (
            nn.Conv2d(3, 16, 3, padding=1),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.Linear(16, 5),
        )

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = torch.relu_(self.conv2(x))
        return self.fc(x.mean((2, 3)))


def test_functional_activations_become_gated_and_functional_max_pool_is_refused():
    model = equiconvert.make_equivariant(_Functional(), "SO2", input_size=9).eval()
    assert sum(isinstance(m, GatedNonlinearity) for m in model.modules()) == 2
    _assert_invariant_logits(model, "SO2")

    class MaxPooled(_Functional):
        def forward(self, x):
            return self.fc(F.max_pool2d(self.conv2(self.conv1(x)), 2).mean((2, 3)))

    with pytest.raises(equiconvert.UnsupportedLayerError, match="norm max pooling"):
        equiconvert.make_equivariant(MaxPooled(), "SO2", input_size=8)


@pytest.mark.parametrize("name", ["O2", "SO2"])
def test_params_width_matches_the_parameter_count(name):
    """width="params" bisects with conversions on the meta device, where NormMaxPool2d must build without data."""
    model = equiconvert.make_equivariant(resnet9(), name, width="params", head="invariant")
    before, after = model.report.params_before, model.report.params_after
    print(f"{name} resnet9 width='params': {after:,} parameters for {before:,}")
    assert abs(after - before) <= 0.02 * before


def test_group_standardization_statistics_stay_fp32_under_bf16_autocast():
    layout = parse_group("O2").layout
    norm = GroupStandardization(4, layout, 2)
    x = (3 + 5 * torch.randn(2, 4 * layout.size, 5, 5)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = norm(x)
    assert low.dtype == torch.float32 and torch.allclose(low, norm(x.float()), atol=1e-5)
