"""Rules for timm's norm-act layers, layer norms over channels, layer scale, channel splits, upsampling, even kernels."""

import pytest
import torch
from timm.layers import BatchNormAct2d, GroupNormAct, LayerNorm2d, LayerScale2d
from timm.layers.conv2d_same import Conv2dSame
from torch import nn

import equiconvert
from equiconvert.nn.layer_norm import FieldLayerNorm
from equiconvert.nn.layer_scale import FieldLayerScale


def _exact(model: nn.Module, **kwargs) -> equiconvert.EquivariantModel:
    converted = equiconvert.make_equivariant(model.eval(), "C4", head="invariant", **kwargs).eval()
    assert converted.report.invariant_output and not converted.report.warnings
    assert equiconvert.check_equivariance(converted, batch_size=1).max_error <= 1e-5
    return converted


class Net(nn.Module):
    def __init__(self, *body: nn.Module, channels: int = 8, out: int | None = None):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.body = nn.Sequential(*body)
        self.head = nn.Linear(out or channels, 2)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def test_norm_act_layers_become_field_norm_then_activation():
    model = _exact(Net(BatchNormAct2d(8, act_layer=nn.SiLU), GroupNormAct(8, 4, act_layer=nn.ReLU)))
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("FieldGroupNorm") == 2 and "SiLU" in kinds and "BatchNormAct2d" not in kinds


def test_layer_norm_2d_has_its_affine_tied_per_field():
    model = _exact(Net(LayerNorm2d(8)))
    (norm,) = [m for m in model.modules() if isinstance(m, FieldLayerNorm)]
    assert norm.weight.shape == (norm.num_fields,) and not norm.channels_last


def test_field_layer_norm_commutes_with_regular_field_permutations():
    norm = FieldLayerNorm(3, 4)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
        norm.bias.normal_()
    x = torch.randn(2, 12, 5, 5)
    shift = torch.arange(12).reshape(3, 4).roll(1, dims=1).flatten()  # a cyclic shift inside every field
    assert torch.allclose(norm(x[:, shift]), norm(x)[:, shift], atol=1e-6)


class ChannelsLastBlock(nn.Module):
    """ConvNeXt's block body: permute, LayerNorm, Linear MLP, permute back, layer scale by a raw parameter."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.fc1, self.act, self.fc2 = nn.Linear(channels, 16), nn.GELU(), nn.Linear(16, channels)
        self.gamma = nn.Parameter(torch.full((channels,), 0.5))

    def forward(self, x):
        y = self.fc2(self.act(self.fc1(self.norm(x.permute(0, 2, 3, 1))))).permute(0, 3, 1, 2)
        return x + y.mul(self.gamma.reshape(1, -1, 1, 1))


def test_channels_last_mlp_and_parameter_layer_scale_convert_exactly():
    model = _exact(Net(ChannelsLastBlock(), LayerScale2d(8, 0.3)))
    names = [name for name, _ in model.named_parameters()]
    assert not any(name.endswith("gamma") and "equiconvert" not in name and "body.1" not in name for name in names)
    scales = [m for m in model.modules() if isinstance(m, FieldLayerScale)]
    assert len(scales) == 2 and {round(float(s.gamma.detach()[0]), 3) for s in scales} == {0.5, 0.3}
    kinds = [type(m).__name__ for m in model.modules()]
    assert kinds.count("ChannelsLastSteerableLinear") == 2


class SplitCat(nn.Module):
    """CSPNet-style: split the channels in halves, convolve one, concatenate."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.conv = nn.Conv2d(channels // 2, channels // 2, 3, padding=1)

    def forward(self, x):
        a, b = x.split(8, dim=1)
        c, d = torch.chunk(self.conv(b), 2, dim=1)
        return torch.cat([a, d + d, c], dim=1)[:, :12]


def test_splits_chunks_and_slices_over_whole_fields_convert_exactly():
    model = _exact(Net(SplitCat(16), nn.Conv2d(12, 8, 1), channels=16, out=8))
    split = next(n for n in model.network.graph.nodes if n.target == "split")
    assert sum(split.args[1]) == model.network.get_submodule("stem").out_channels  # sizes in the new channels


def test_a_split_through_fields_is_refused_naming_node_and_options():
    class Uneven(nn.Module):
        def forward(self, x):
            return x[:, :3]

    def one_field(channels, group):
        return 1

    # the grouped conv needs 4 fields for its 8 channels, so channel 3 falls inside the first field
    net = Net(nn.Conv2d(8, 8, 3, padding=1, groups=4), Uneven(), nn.Conv2d(3, 8, 1))
    with pytest.raises(
        equiconvert.UnsupportedLayerError, match="cannot convert node 'getitem'.*cuts through the fields.*Options"
    ):
        equiconvert.make_equivariant(net, "C4", width=one_field)


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_integer_upsampling_is_exact_and_scales_the_valid_sizes(mode):
    model = _exact(
        Net(
            nn.Conv2d(8, 8, 3, stride=2, padding=1),
            nn.Upsample(scale_factor=2, mode=mode),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.AvgPool2d(2),
        )
    )
    # odd H for the stride-2 conv, then (H+1)/2 doubled: the 2x2 pool sees H+1, even
    assert model.report.valid_input_sizes[:3] == [9, 11, 13]


def test_even_kernels_are_refused_by_default_and_grown_on_request():
    net = Net(nn.Conv2d(8, 8, 4, stride=4))
    with pytest.raises(equiconvert.UnsupportedLayerError, match="even kernel_size=4.*even_kernels"):
        equiconvert.make_equivariant(net, "C4")
    model = _exact(net, config={"even_kernels": "grow"})
    grown = [c for c in model.report.layers if "even_kernels='grow'" in c.after]
    assert [(c.module_path, c.before) for c in grown] == [("body.0", "kernel 4x4")]
    assert all(s % 4 == 1 for s in model.report.valid_input_sizes)
    with pytest.raises(ValueError, match="even_kernels must be one of"):
        equiconvert.make_equivariant(net, "C4", config={"even_kernels": "shrink"})


def test_tensorflow_same_padding_converts_exactly_at_odd_sizes():
    model = _exact(Net(Conv2dSame(8, 8, 3, stride=2)))
    assert model.report.valid_input_sizes[0] % 2 == 1 and all(s % 2 for s in model.report.valid_input_sizes)


def test_eca_gate_scales_whole_fields_from_invariant_statistics():
    from timm.layers import EcaModule

    from equiconvert.nn.gates import FieldEcaGate

    model = _exact(Net(nn.Conv2d(8, 16, 3, padding=1), EcaModule(16, kernel_size=3), channels=8, out=16))
    (gate,) = [m for m in model.modules() if isinstance(m, FieldEcaGate)]
    assert gate.weight.shape == (1, 1, 3)
