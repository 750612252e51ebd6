"""Tests for the Klause et al. ResNet9 baseline."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

from equiconvert.models import resnet9


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_param_count_without_scale_norm() -> None:
    assert n_params(resnet9(num_classes=10, scale_norm=False)) == 2_447_946


def test_param_count_with_scale_norm() -> None:
    assert n_params(resnet9(num_classes=10, scale_norm=True)) == 2_448_714


def test_scale_norm_difference() -> None:
    diff = n_params(resnet9(scale_norm=True)) - n_params(resnet9(scale_norm=False))
    assert diff == 2 * (128 + 256)


def test_convs_have_no_bias_and_groupnorm_groups() -> None:
    model = resnet9()
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 8
    assert all(c.bias is None for c in convs)
    gns = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert len(gns) == 10  # 8 after convs + 2 ScaleNorms
    assert all(g.num_groups == min(32, g.num_channels) and g.affine for g in gns)


def test_output_shape_cifar() -> None:
    model = resnet9().eval()
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()


def test_output_shape_mnist_like() -> None:
    model = resnet9(num_classes=7, in_channels=1).eval()
    out = model(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, 7)


@pytest.mark.parametrize("norm", ["group", "batch", "instance", "none"])
@pytest.mark.parametrize("scale_norm", [True, False])
def test_fx_trace_matches(norm: str, scale_norm: bool) -> None:
    torch.manual_seed(0)
    model = resnet9(norm=norm, scale_norm=scale_norm).eval()
    traced = torch.fx.symbolic_trace(model)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
        got = traced(x)
    assert torch.equal(expected, got)
    # The traced graph should contain the residual adds as explicit nodes.
    adds = [n for n in traced.graph.nodes if n.op == "call_function" and "add" in str(n.target)]
    assert len(adds) == 2


def test_norm_variants_types() -> None:
    expected = {
        "group": nn.GroupNorm,
        "batch": nn.BatchNorm2d,
        "instance": nn.InstanceNorm2d,
        "none": nn.Identity,
    }
    for name, cls in expected.items():
        model = resnet9(norm=name)
        assert isinstance(model.stem[1], cls), name
    inst = resnet9(norm="instance").stem[1]
    assert inst.affine


def test_unknown_norm_raises() -> None:
    with pytest.raises(ValueError, match="group"):
        resnet9(norm="layer")


def test_act_instantiated_per_use() -> None:
    model = resnet9(act=nn.ReLU)
    acts = [m for m in model.modules() if isinstance(m, nn.ReLU)]
    assert len(acts) == 8
    assert len({id(a) for a in acts}) == 8
    assert not any(isinstance(m, nn.Mish) for m in model.modules())


def test_small_widths() -> None:
    small = resnet9(widths=(16, 32, 64))
    assert n_params(small) < n_params(resnet9())
    linear = small.head[-1]
    assert isinstance(linear, nn.Linear)
    assert linear.in_features == 64 * 4
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_a_converted_resnet9_is_invariant_unless_its_head_is_kept() -> None:
    import equiconvert
    from equiconvert.convert.context import ConversionConfig

    def converted(**options):
        return equiconvert.make_equivariant(resnet9(widths=(4, 8, 8)), group="C4", **options)

    assert equiconvert.check_equivariance(converted(), input_size=32).max_error < 1e-5
    for keep in ({"head": "keep"}, {"config": {"head": "keep"}}, {"config": ConversionConfig()}):
        with pytest.warns(Warning, match="flattens a 2x2 grid"):
            model = converted(**keep)
        assert equiconvert.check_equivariance(model, input_size=32).max_error > 1e-3
