"""Hand-written CNNs: the input read from the graph, transposed-conv decoders, concatenations and their slices."""

import pytest
import torch
from torch import nn

import equiconvert
from equiconvert.errors import UnsupportedLayerError


def _exact(model, size: int) -> float:
    return equiconvert.check_equivariance(model, input_size=size).max_error


class Order(nn.Module):
    """Modules registered in another order than they run: the stem comes after the body."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU())
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(self.body(self.stem(x)).mean((2, 3)))


def test_input_channels_come_from_the_first_conv_the_forward_runs():
    model = equiconvert.make_equivariant(Order(), "D4", input_size=32)
    assert model.in_channels == 3 and model.report.invariant_output
    assert model.report.params_before == sum(p.numel() for p in Order().parameters())
    assert _exact(model, 32) < 1e-5


class UNet(nn.Module):
    """A one-level UNet whose decoder up-samples with a transposed conv; per-pixel logits."""

    def __init__(self, kernel: int = 2, padding: int = 0, output_padding: int = 0):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(16, 8, kernel, stride=2, padding=padding, output_padding=output_padding)
        self.dec = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        skip = self.enc1(x)
        return self.head(self.dec(torch.cat((skip, self.up(self.enc2(skip))), 1)))


@pytest.mark.parametrize("kernel, padding", [(2, 0), (4, 1)])
def test_unet_with_a_transposed_conv_is_per_pixel_equivariant_and_exports(kernel, padding):
    original = UNet(kernel, padding)
    model = equiconvert.make_equivariant(original, "D4", input_size=16)
    report = model.report
    assert report.per_pixel_output and not report.invariant_output
    assert "output: per-pixel equivariant" in str(report)
    assert report.params_before == sum(p.numel() for p in original.parameters())
    assert any(c.after.startswith("SteerableConvTranspose2d") for c in report.layers)
    assert _exact(model, 16) < 1e-5
    x = torch.randn(2, 3, 16, 16)
    plain = equiconvert.export(model.eval())
    assert any(isinstance(m, nn.ConvTranspose2d) for m in plain.modules())
    torch.testing.assert_close(plain(x), model(x), atol=1e-5, rtol=1e-5)


def test_transposed_conv_output_padding_is_refused_with_the_centred_settings():
    with pytest.raises(UnsupportedLayerError, match=r"node 'up'.*output_padding.*kernel_size=2, stride=2"):
        equiconvert.make_equivariant(UNet(3, 1, output_padding=1), "D4", input_size=16)


def test_even_transposed_kernel_under_a_group_off_the_grid_is_refused():
    with pytest.raises(UnsupportedLayerError, match=r"node 'up'.*even kernel_size=2 under C8.*C4 or D4"):
        equiconvert.make_equivariant(UNet(), "C8", input_size=16)


class Dense(nn.Module):
    """Dense connections that keep the input image: its trivial channels beside regular fields, then a slice."""

    def __init__(self, keep: slice = slice(-32, None)):
        super().__init__()
        self.keep = keep
        self.b1 = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.SELU())
        self.b2 = nn.Sequential(nn.Conv2d(35, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.SELU())
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = torch.cat((x, self.b1(x)), 1)
        x = torch.cat((x, self.b2(x)), 1)
        x = x[:, self.keep]
        return self.fc(x.mean((2, 3)))


def test_image_beside_regular_fields_is_a_direct_sum_read_by_one_basis_per_part():
    original = Dense()
    model = equiconvert.make_equivariant(original, "D4", input_size=16)
    report = model.report
    assert report.params_before == sum(p.numel() for p in original.parameters())
    (mixed,) = [c for c in report.layers if c.node == "b2_0"]
    assert mixed.after.startswith("DirectSumConv2d(fields 3x1 + 14x8 -> 14x8")
    assert not any("FieldLift" in c.after for c in report.layers)  # nothing needed lifting
    assert _exact(model, 16) < 1e-5
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(equiconvert.export(model.eval())(x), model(x), atol=1e-5, rtol=1e-5)
    again = equiconvert.make_equivariant(Dense(), "D4", input_size=16).eval()
    again.load_state_dict(model.state_dict())  # the parts' coefficients and their bases' fingerprints
    torch.testing.assert_close(again(x), model(x))


class Cut(nn.Module):
    """Keeps 2 of the 32 maps of a depthwise conv, whose field count its input fixes (2 x 7 fields of 8)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.depthwise = nn.Conv2d(16, 32, 3, padding=1, groups=16)
        self.fc = nn.Linear(2, 10)

    def forward(self, x):
        return self.fc(self.depthwise(self.stem(x))[:, :2].mean((2, 3)))


def test_a_slice_that_cuts_fields_is_refused_naming_the_node_and_the_fix():
    with pytest.raises(UnsupportedLayerError, match=r"node 'getitem'.*channels 0:2 of 32.*Options: select whole"):
        equiconvert.make_equivariant(Cut(), "D4", input_size=16)


class DenseStem(nn.Module):
    """A stem, then blocks whose channel counts the width policy does not divide alike (16 + 12 + 12)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.b1 = nn.Sequential(nn.Conv2d(16, 12, 3, padding=1), nn.ReLU())
        self.b2 = nn.Sequential(nn.Conv2d(28, 12, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(12, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.cat((x, self.b1(x)), 1)
        x = torch.cat((x, self.b2(x)), 1)
        return self.fc(x[:, -12:].mean((2, 3)))


def test_a_slice_of_a_concatenation_selects_the_block_it_names():
    model = equiconvert.make_equivariant(DenseStem(), "D4", input_size=16)
    (slice_node,) = [n for n in model.network.graph.nodes if n.name == "getitem"]
    assert slice_node.args[1][1] == slice(12 * 8, 17 * 8)  # fields 7 (stem) + 5 (b1), then b2's 5 fields
    assert _exact(model, 16) < 1e-5


class Mixed(nn.Module):
    """A norm on the image-and-features concatenation (read lifted), and its split, chunk and narrow."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 13, 3, padding=1)
        self.norm = nn.GroupNorm(1, 16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 8, 3, padding=1)
        self.fc = nn.Linear(16 + 13 + 8 + 3, 5)

    def forward(self, x):
        y = torch.cat((x, torch.tanh(self.conv1(x))), 1)
        z = self.conv2(torch.relu(self.norm(y)))
        image, features = torch.split(y, [3, 13], 1)
        first, second = y.chunk(2, 1)  # 8 + 8 channels: the image's 3 and 5 features, then 8 features
        swapped = self.conv3(torch.cat((second, first), 1))
        pooled = (t.mean((2, 3)) for t in (z, features.narrow(1, 0, 13), swapped, image))
        return self.fc(torch.cat(tuple(pooled), 1))


def test_layers_without_direct_sums_read_them_lifted_and_splits_select_parts():
    assert _exact(equiconvert.make_equivariant(Mixed(), "D4", input_size=16), 16) < 1e-5
    model = equiconvert.make_equivariant(Mixed(), "D4", input_size=16, width=lambda channels, group: channels)
    changes = {c.node: c.after for c in model.report.layers}
    assert "FieldLift(107 -> 128 channels)" in changes.values()  # 3 trivial + 13 regular fields, for the norm
    assert changes["chunk"] == "split into [43, 64] channels"  # 3 trivial + 5 regular fields, then 8 regular
    assert _exact(model, 16) < 1e-5
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(equiconvert.export(model.eval())(x), model(x), atol=1e-5, rtol=1e-5)


class DenseThenPool(nn.Module):
    """SmoothNet's pattern: a dense block keeping the image, a 1x1 transition and a pool, then a second block."""

    def __init__(self):
        super().__init__()
        self.b1 = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SELU())
        self.transition = nn.Sequential(nn.Conv2d(19, 16, 1), nn.AvgPool2d(2))
        self.b2 = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SELU())
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.transition(torch.cat((x, self.b1(x)), 1))
        return self.fc(self.b2(x).mean((2, 3)))


@pytest.mark.parametrize("options", [{"mode": "dp"}, {"restrict": "D4->D1"}])
def test_a_restriction_placed_on_a_concatenation_with_the_image_restricts_its_lifted_fields(options):
    model = equiconvert.make_equivariant(DenseThenPool(), "D4", input_size=16, **options)
    lifted = [c for c in model.report.layers if "FieldLift" in c.after]
    assert len(lifted) == 1  # the image's trivial fields lifted once, where the restriction is placed
    result = equiconvert.check_equivariance(model, input_size=16)
    assert set(result.errors) == {"rot0", "rot0+flip"}  # D1 from the restriction on
    assert result.max_error < 1e-5  # exactly invariant to the flips it keeps
