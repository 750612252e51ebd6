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
