"""Any input size: invalid sizes are refused with the nearest valid ones, or fitted symmetrically and stay exact."""

import pytest
import torch
import torchvision
from torch import nn

import equiconvert
from equiconvert.errors import InvalidInputSizeError
from equiconvert.export import export
from equiconvert.nn import InputFit

GRID_ELEMENTS = {
    "rot90": lambda x: x.rot90(1, (-2, -1)),
    "rot180": lambda x: x.rot90(2, (-2, -1)),
    "rot270": lambda x: x.rot90(3, (-2, -1)),
    "flip": lambda x: x.flip(-1),
    "transpose": lambda x: x.transpose(-1, -2),
}


@pytest.mark.parametrize("size, target", [(224, 225), (224, 193), (31, 33), (33, 31), (6, 11), (10, 7), (5, 4)])
def test_input_fit_commutes_with_the_grid_rotations_and_flips(size, target):
    fit = InputFit(size, target)
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    y = fit(x)
    assert y.shape == (2, 3, target, target)
    for name, g in GRID_ELEMENTS.items():
        torch.testing.assert_close(fit(g(x)), g(y), rtol=0, atol=1e-12, msg=name)


def test_input_fit_keeps_the_pixels_and_adds_the_centre_mean():
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    y = InputFit(4, 5)(x)[0, 0]
    torch.testing.assert_close(y[[0, 1, 3, 4]][:, [0, 1, 3, 4]], x[0, 0])
    torch.testing.assert_close(y[2], (y[1] + y[3]) / 2)
    assert torch.equal(InputFit(3, 5)(torch.ones(1, 1, 3, 3))[0, 0, 0], torch.zeros(5))  # zero padding a side
    with pytest.raises(ValueError, match="converted for 4x4 inputs"):
        InputFit(4, 5)(torch.ones(1, 1, 5, 5))


def _small_resnet():
    return torchvision.models.resnet18(num_classes=4)


def test_an_invalid_size_is_an_error_naming_the_nearest_valid_sizes():
    with pytest.raises(InvalidInputSizeError, match=r"input size 224 .*nearest: 193, 225\). Pass pad_to_valid=True"):
        equiconvert.make_equivariant(_small_resnet(), "C4", input_size=224)
    with pytest.raises(ValueError, match="need the input_size"):
        equiconvert.make_equivariant(_small_resnet(), "C4", pad_to_valid=True)


def _two_stride_two_stages():
    """Valid sizes 1 mod 4 (two stride-2 3x3 convs): 224 is not, 225 and 221 are."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


@pytest.mark.parametrize("option, target", [("pad_to_valid", 225), ("crop_to_valid", 221)])
def test_224_fitted_is_exactly_invariant_under_every_grid_element(option, target):
    torch.manual_seed(0)
    model = equiconvert.make_equivariant(
        _two_stride_two_stages(), "D4", input_size=224, head="invariant", **{option: True}
    ).eval()
    report = model.report
    assert report.input_size == 224 and report.input_size_valid and report.valid_input_sizes == [224]
    assert report.input_fit.startswith(f"input 224 -> {target}")
    assert f"input fit: input 224 -> {target}" in str(report)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        out = model(x)
        errors = {name: float((model(g(x)) - out).abs().max() / out.abs().max()) for name, g in GRID_ELEMENTS.items()}
    assert max(errors.values()) < 1e-5, errors
    # the same size change on one side only (negative padding crops): not exact, as the check must see
    model.network.input_fit = nn.ZeroPad2d((0, target - 224, 0, target - 224))
    with torch.no_grad():
        lopsided = model(x)
        assert max(float((model(g(x)) - lopsided).abs().max()) for g in GRID_ELEMENTS.values()) > 1e-3 * float(
            lopsided.abs().max()
        )
    model.network.input_fit = InputFit(224, target)
    assert equiconvert.check_equivariance(model, batch_size=1).max_error < 1e-5  # at 224, the model's own size
    plain = export(model)
    assert not any(type(m).__module__.startswith("equiconvert") for m in plain.modules())
    with torch.no_grad():
        torch.testing.assert_close(plain(x), out, rtol=1e-4, atol=1e-5)


def test_a_valid_size_needs_no_fit():
    model = equiconvert.make_equivariant(_two_stride_two_stages(), "C4", input_size=225, pad_to_valid=True)
    assert model.report.input_fit is None and not hasattr(model.network, "input_fit")
