"""ConvNeXt-T (torchvision and timm) converts exactly with even_kernels="grow" (its 4x4 stem and 2x2 downsamplers)."""

import pytest
import timm
import torchvision

import equiconvert

FULL_SIZE = {
    "torchvision convnext_tiny": lambda: torchvision.models.convnext_tiny(num_classes=10),
    "timm convnext_tiny": lambda: timm.create_model("convnext_tiny", num_classes=10),
}


def _check(original) -> equiconvert.EquivariantModel:
    model = equiconvert.make_equivariant(original.eval(), "C4", head="invariant", config={"even_kernels": "grow"})
    grown = [c.module_path for c in model.report.layers if "even_kernels='grow'" in c.after]
    assert len(grown) == 4  # the 4x4 stride-4 stem and three 2x2 stride-2 downsamplers
    assert model.report.invariant_output and not model.report.warnings
    assert model.report.valid_input_sizes[0] == 61  # 5x5/4 then three 3x3/2 windows: H = 29 mod 32
    return model


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FULL_SIZE))
def test_full_size_convnext_tiny_converts_exactly(name):
    model = _check(FULL_SIZE[name]()).double()  # in float64: fp32 rounding of a deep net is near 1e-5
    assert equiconvert.check_equivariance(model, batch_size=1).max_error <= 1e-5
