"""Conversion proves that the converted graph runs: no model is returned that fails where the original runs."""

import pytest
import timm
import torch
import torch.fx as fx
from torch import nn

import equiconvert
from equiconvert.convert.registry import MODULE_RULES, register_module_rule


@pytest.mark.parametrize("name, breaks", [("dla34", "level1_0"), ("hrnet_w18_small", "conv1")])
def test_timm_models_exact_at_no_size_are_refused_naming_the_layer_that_breaks_it(name, breaks):
    original = timm.create_model(name, pretrained=False, num_classes=3).eval()
    with pytest.raises(
        equiconvert.EquivarianceBreakError, match=f"no size from 8 to 1024 keeps exact equivariance: node '{breaks}'"
    ):
        equiconvert.make_equivariant(original, "D4", head="invariant")


def test_dla34_kept_with_allow_non_equivariant_warns_and_runs_where_the_original_runs():
    original = timm.create_model("dla34", pretrained=False, num_classes=3).eval()
    with pytest.warns(equiconvert.EquivarianceWarning, match="node 'level1_0'.*equivariant only approximately"):
        model = equiconvert.make_equivariant(original, "D4", head="invariant", allow_non_equivariant=True).eval()
    assert model.report.valid_input_sizes == []
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == original(torch.randn(1, 3, 64, 64)).shape == (1, 3)


class _Keep(nn.Module):
    def forward(self, x):
        return x


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.keep = _Keep()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        x = self.conv(x)
        x = x + self.keep(x)
        return self.fc(self.pool(x).flatten(1))


def test_a_rule_that_breaks_shapes_is_caught_and_names_the_node():
    def shrinking_rule(ctx, node: fx.Node):  # a defective rule: halves the map but reports no spatial op
        ctx.replace_module(node, nn.AvgPool2d(2))
        return ctx.field_input(node)

    register_module_rule(_Keep)(shrinking_rule)
    try:
        with pytest.raises(
            equiconvert.UnsupportedLayerError, match="fails at node 'add'.*32x32 input where the original runs"
        ):
            equiconvert.make_equivariant(_Residual(), "C4", input_size=32)
    finally:
        del MODULE_RULES[_Keep]


def test_the_size_a_check_runs_at_is_the_first_valid_one_from_32_else_the_largest():
    from types import SimpleNamespace

    from equiconvert.convert.model import EquivariantModel
    from equiconvert.convert.verify import MIN_CHECK_SIZE, preferred_valid_size

    assert MIN_CHECK_SIZE == 32
    assert preferred_valid_size([9, 17, 33, 65]) == 33
    assert preferred_valid_size([8, 16, 24]) == 24
    assert preferred_valid_size([]) is None

    def default(requested, valid, sizes):
        report = SimpleNamespace(input_size=requested, input_size_valid=valid, valid_input_sizes=sizes)
        return EquivariantModel.default_input_size(SimpleNamespace(report=report))

    assert default(65, True, [33, 65]) == 65
    assert default(64, False, [33, 65]) == 33
    assert default(None, None, [8, 16, 24]) == 24  # the same size conversion ran at
    with pytest.raises(ValueError, match="no input size"):
        default(None, None, [])
