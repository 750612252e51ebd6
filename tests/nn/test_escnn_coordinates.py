"""Weight standardization in escnn's coordinates (standardization_coordinates): the filter escnn's R2Conv gives for
standardized coefficients, the closed-form VJP, equivariance, and how the option reaches, moves and refuses."""

from __future__ import annotations

import pytest
import torch

import equiconvert
from equiconvert._escnn_compat import import_escnn
from equiconvert.bases.escnn_reference import escnn_basis, escnn_coordinates
from equiconvert.basis import steerable_basis
from equiconvert.check import act_on_output
from equiconvert.convert.fields import FieldType
from equiconvert.errors import ParameterError
from equiconvert.groups import parse_group
from equiconvert.models import equivariant_resnet9
from equiconvert.nn import SteerableConv2d

import_escnn()  # through equiconvert first: it registers its lie_learn stand-in under NumPy 2

CUTOFF = 3.0  # the paper's band limit 3r, the released code's
# (group, input representation): the released D4 model's layers (lifting, hidden) and the D2 ones after its restriction
LAYERS = [("D4", "trivial"), ("D4", "regular"), ("D2", "regular")]


def _conv(group: str, in_repr: str, scope: str = "layer", in_fields: int = 2, out_fields: int = 3) -> SteerableConv2d:
    """A conv standardizing in escnn's coordinates, its coefficients of different scales and offsets per field."""
    spec = parse_group(group)
    conv = SteerableConv2d(
        steerable_basis(spec, in_repr, "regular", 3, cutoff=CUTOFF),
        in_fields,
        out_fields,
        padding=1,
        weight_standardization=scope,
        standardization_coordinates=escnn_coordinates(spec, in_repr, "regular", 3, cutoff=CUTOFF),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        scale = torch.linspace(0.2, 2.0, out_fields)[:, None, None]
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator) * scale + scale)
        conv.bias.normal_(generator=generator)
    return conv


def _escnn_conv(group: str, in_repr: str, in_fields: int, out_fields: int):
    """escnn's R2Conv as the released code builds it (hlzl/equivariant networks/equivariant_layers.py)."""
    from escnn import nn as enn

    spec = parse_group(group)
    gspace = spec.escnn_gspace()
    in_type = enn.FieldType(gspace, [spec.escnn_repr(in_repr)] * in_fields)
    out_type = enn.FieldType(gspace, [spec.escnn_repr("regular")] * out_fields)
    return enn.R2Conv(
        in_type, out_type, 3, padding=1, bias=False, initialize=False, frequencies_cutoff=lambda r: CUTOFF * r
    )


@pytest.mark.parametrize("group,in_repr", LAYERS)
def test_escnn_expands_every_field_pair_with_one_basis_whose_coordinates_are_ours_times_a(group, in_repr):
    """escnn's weight i of a layer is basis filter i % n of field pair (i // n // in_fields, i // n % in_fields):
    one (n, n) matrix A maps our coefficients of every block to escnn's, exactly (to float32 rounding)."""
    spec = parse_group(group)
    in_fields, out_fields = 2, 3
    conv = _escnn_conv(group, in_repr, in_fields, out_fields)
    block = escnn_basis(spec, in_repr, "regular", 3, 1, CUTOFF)
    n, out_size, in_size = block.shape[:3]
    assert conv.basisexpansion.dimension() == out_fields * in_fields * n
    with torch.no_grad():
        unit = torch.eye(conv.basisexpansion.dimension())
        expanded = torch.stack([conv.basisexpansion(e) for e in unit])
    expanded = expanded.reshape(out_fields, in_fields, n, out_fields, out_size, -1, 3, 3)
    for o in range(out_fields):
        for i in range(in_fields):
            blocks = expanded[o, i][:, :, :, in_size * i : in_size * (i + 1)]  # (n, out field, out_size, in_size, k, k)
            assert torch.equal(blocks[:, o], block)
            assert not blocks[:, [f for f in range(out_fields) if f != o]].any()
    ours = steerable_basis(spec, in_repr, "regular", 3, cutoff=CUTOFF).double().flatten(1)
    coordinates = escnn_coordinates(spec, in_repr, "regular", 3, cutoff=CUTOFF)
    assert coordinates.shape == (n, n)
    assert float((coordinates @ block.double().flatten(1) - ours).norm() / ours.norm()) < 1e-6
    assert float(torch.linalg.cond(coordinates)) < 10  # escnn's basis filters have norms 1 to 1.41


@pytest.mark.parametrize("group,in_repr", LAYERS)
def test_the_filter_is_escnns_for_its_coefficients_standardized_over_the_layer(group, in_repr):
    """Our weight w and escnn's coefficients w @ A standardized as the released code does (rd_convolution.py:
    std and mean over the layer's whole vector, eps added to the std) give the same filter."""
    conv = _conv(group, in_repr)
    escnn_conv = _escnn_conv(group, in_repr, conv.in_fields, conv.out_fields)
    coefficients = (conv.weight.detach().double() @ conv.standardization_coordinates.double()).flatten()
    std, mean = torch.std_mean(coefficients, unbiased=False)
    standardized = ((coefficients - mean) / (std + 1e-5)).float()
    with torch.no_grad():
        expected = escnn_conv.basisexpansion(standardized).reshape(conv.out_channels, conv.in_channels, 3, 3)
        got = conv.expand_filter()
        assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5
        # standardizing our own coordinates gives another filter
        conv.standardization_coordinates = conv.standardization_coordinates_inverse = None
        assert float((conv.expand_filter() - expected).abs().max() / expected.abs().max()) > 0.05


@pytest.mark.parametrize("scope", ["layer", "field"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_weight_gradients_equal_autograds_vjp_of_the_coefficients(scope, dtype, tolerance):
    """The closed-form VJP in escnn's coordinates against torch.func's, for random per-example gradients."""
    from torch.func import vjp, vmap

    conv = _conv("D4", "regular", scope).to(dtype)
    grads = torch.randn(4, *conv.weight.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    _, pullback = vjp(conv.coefficients, conv.weight.detach())
    expected = vmap(lambda g: pullback(g)[0])(grads)
    got = conv.weight_gradients(grads)
    assert got.shape == expected.shape == grads.shape and got.dtype == dtype
    assert float((got - expected).abs().max() / expected.abs().max()) < tolerance
    assert conv.weight_gradients(grads[:0]).shape == (0, *conv.weight.shape)


@pytest.mark.parametrize("group,in_repr", LAYERS)
def test_the_conv_stays_exactly_equivariant(group, in_repr):
    conv = _conv(group, in_repr, in_fields=3, out_fields=4).double()
    spec = parse_group(group)
    in_type, out_type = FieldType(spec, in_repr, 3), FieldType(spec, "regular", 4)
    x = torch.randn(2, in_type.channels, 9, 9, dtype=torch.float64)
    with torch.no_grad():
        y = conv(x)
        for g in spec.grid_elements:
            error = (conv(act_on_output(g, x, in_type)) - act_on_output(g, y, out_type)).abs().max()
            assert float(error / y.abs().max()) < 1e-12, g.name


def test_the_option_reaches_every_conv_of_the_preset_and_keeps_the_state_dict():
    options = {"weight_standardization": "layer", "norm_group_rule": "released", "unit_norm_bias": True}
    escnn = equivariant_resnet9("D4", standardization_coordinates="escnn", **options)
    canonical = equivariant_resnet9("D4", **options)
    convs = [m for m in escnn.modules() if isinstance(m, SteerableConv2d)]
    assert (
        [c.standardization_coordinates.shape[0] for c in convs]
        == [c.num_basis for c in convs]
        == [8] + [64] * 4 + [32] * 3
    )
    assert all(c.standardization_coordinates is None for c in canonical.modules() if isinstance(c, SteerableConv2d))
    assert "standardization_coordinates=given" in repr(convs[1])  # runs record the architecture in OUT/model.txt
    assert "standardization_coordinates" not in repr(canonical)
    state = escnn.state_dict()
    assert state.keys() == canonical.state_dict().keys()  # constants, no state: checkpoints load either way
    canonical.load_state_dict(state)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert float((escnn.eval()(x) - canonical.eval()(x)).abs().max()) > 1e-3  # the same weights, another function
        reloaded = equivariant_resnet9("D4", standardization_coordinates="escnn", **options).eval()
        reloaded.load_state_dict(state)
        assert torch.equal(reloaded(x), escnn(x))
        escnn.double()
        assert {c.standardization_coordinates_inverse.dtype for c in convs} == {torch.float64}
        assert float((escnn(x.double()) - reloaded(x).double()).abs().max()) < 1e-4


def test_bad_coordinates_are_refused_by_name():
    plain = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    with pytest.raises(ParameterError, match="standardization_coordinates must be one of"):
        equiconvert.make_equivariant(plain, "C4", config={"standardization_coordinates": "escn"})
    basis = steerable_basis(parse_group("C4"), "regular", "regular", 3)
    n = basis.shape[0]
    for bad, message in (
        (torch.eye(n + 1), "must be a \\("),
        (torch.zeros(n, n), "must be a finite, invertible"),
        (torch.full((n, n), float("nan")), "must be a finite, invertible"),
    ):
        with pytest.raises(ParameterError, match=f"standardization_coordinates {message}"):
            SteerableConv2d(basis, 2, 2, weight_standardization="layer", standardization_coordinates=bad)
    with pytest.raises(ParameterError, match="standardization_coordinates needs weight_standardization"):
        SteerableConv2d(basis, 2, 2, standardization_coordinates=torch.eye(n))
