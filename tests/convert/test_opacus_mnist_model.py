"""Opacus' MNIST example model (8x8 and 4x4 kernels, a flatten of a 4x4 grid) converts, or says what to change."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equiconvert


class SampleConvNet(nn.Module):
    """The model of Opacus' examples/mnist.py, layer for layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)
        x = x.view(-1, 32 * 4 * 4)
        return self.fc2(F.relu(self.fc1(x)))


def test_grown_kernels_with_an_invariant_head_are_exactly_equivariant_at_a_valid_size():
    model = equiconvert.make_equivariant(
        SampleConvNet(), group="C4", head="invariant", config={"even_kernels": "grow"}
    ).eval()
    size = model.default_input_size()
    assert size in model.report.valid_input_sizes
    assert equiconvert.check_equivariance(model, input_size=size).max_error < 1e-5
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_grown_kernels_before_a_fixed_size_flatten_are_refused_naming_the_node_and_the_fix():
    with pytest.raises(equiconvert.UnsupportedLayerError) as refused:
        equiconvert.make_equivariant(SampleConvNet(), group="C4", config={"even_kernels": "grow"})
    message = str(refused.value)
    assert "node 'view'" in message and "['conv1', 'conv2']" in message and "head='invariant'" in message
    assert "conversion defect" not in message
