"""The plain-tensor equivariant modules, each checked against the group action."""

import math

import pytest
import torch
import torch.nn.functional as F

from equiconvert.basis import steerable_basis
from equiconvert.check import act_on_output
from equiconvert.convert.fields import FieldType
from equiconvert.groups import parse_group
from equiconvert.nn import FieldGroupNorm, GroupPool, SteerableConv2d


def _relative(a, b):
    return float((a - b).abs().max() / b.abs().max().detach())


def _conv(group, in_repr, in_fields, out_fields, kernel=3, **kwargs):
    basis = steerable_basis(group, in_repr, "regular", kernel)
    return SteerableConv2d(basis, in_fields, out_fields, **kwargs)


@pytest.mark.parametrize("group_name", ["C4", "D4", "C8", "D2"])
@pytest.mark.parametrize(
    "in_repr,kwargs,size",
    [
        ("trivial", dict(padding=1), 9),
        ("regular", dict(padding=1, stride=2), 9),  # stride 2 needs an odd size
        ("regular", dict(padding=2, dilation=2), 8),
        ("regular", dict(padding="same"), 8),
        ("regular", dict(padding=1, groups=2, bias=False), 8),
        ("regular", dict(padding=1, padding_mode="reflect"), 8),
        ("regular", dict(padding=1, padding_mode="circular", weight_standardization=True), 8),
    ],
)
def test_steerable_conv_is_equivariant(group_name, in_repr, kwargs, size):
    group = parse_group(group_name)
    conv = _conv(group, in_repr, 4, 6, **kwargs).double()  # float64: the bound tests the basis, not fp32 rounding
    with torch.no_grad():
        if conv.bias is not None:
            conv.bias.normal_()
    in_type = FieldType(group, in_repr, 4)
    out_type = FieldType(group, "regular", 6)
    x = torch.randn(2, in_type.channels, size, size, dtype=torch.float64)
    y = conv(x)
    for g in group.grid_elements:
        assert _relative(conv(act_on_output(g, x, in_type)), act_on_output(g, y, out_type)) < 1e-12, g.name


def test_depthwise_field_conv_is_equivariant_and_field_wise():
    group = parse_group("D4")
    conv = _conv(group, "regular", 5, 5, padding=1, groups=5)
    assert conv.expand_filter().shape == (40, 8, 3, 3)
    fields = FieldType(group, "regular", 5)
    x = torch.randn(1, 40, 7, 7)
    for g in group.grid_elements:
        assert _relative(conv(act_on_output(g, x, fields)), act_on_output(g, conv(x), fields)) < 1e-6
    x2 = x.clone()
    x2[:, 8:16] += 1.0  # change field 1 only
    changed = (conv(x2) - conv(x)).abs().amax(dim=(0, 2, 3)).reshape(5, 8).amax(1)
    assert changed[1] > 0 and torch.all(changed[[0, 2, 3, 4]] == 0)


def test_parameters_live_in_coefficient_space():
    conv = _conv(parse_group("D4"), "regular", 3, 2)
    assert conv.weight.shape == (2, 3, conv.num_basis)
    assert {n for n, _ in conv.named_parameters()} == {"weight", "bias"}
    assert not dict(conv.named_buffers())  # Opacus refuses trainable modules with buffers
    conv.to(torch.float64)
    assert conv.basis.dtype == torch.float64 and conv.weight.dtype == torch.float64


def test_he_initialisation_preserves_second_moment():
    """He init: each output channel receives variance 2 x (input variance) per unit fan-in energy."""
    torch.manual_seed(1)
    group = parse_group("C4")
    conv = _conv(group, "regular", 64, 64, padding=1, bias=False)
    x = torch.randn(4, conv.in_channels, 16, 16)
    second_moment = conv(x)[..., 1:-1, 1:-1].pow(2).mean()
    assert 1.4 < float(second_moment) < 2.6


def test_init_gain_sets_the_initial_filter_scale():
    """std = gain/sqrt(fan-in): gain 1 gives output variance 1, and the coefficients are He's divided by sqrt(2)."""
    group = parse_group("C4")
    torch.manual_seed(1)
    he = _conv(group, "regular", 64, 64, padding=1, bias=False)
    torch.manual_seed(1)
    unit = _conv(group, "regular", 64, 64, padding=1, bias=False, init_gain=1.0)
    assert torch.allclose(he.weight, unit.weight * math.sqrt(2.0))
    x = torch.randn(4, unit.in_channels, 16, 16)
    with torch.no_grad():
        assert 0.7 < float(unit(x)[..., 1:-1, 1:-1].pow(2).mean()) < 1.3
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="init_gain must be positive"):
            _conv(group, "regular", 2, 2, init_gain=bad)


@pytest.mark.parametrize("standardized", [True, False])
def test_weight_gradients_equal_autograds_vjp_of_the_coefficients(standardized):
    """The closed-form VJP of the weight standardization against torch.func's, per example, in float64."""
    from torch.func import vjp, vmap

    conv = _conv(parse_group("D2"), "regular", 3, 5, weight_standardization=standardized).double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator, dtype=torch.float64) * 0.3 + 0.1)
    grads = torch.randn(4, *conv.weight.shape, generator=generator, dtype=torch.float64)
    _, pullback = vjp(conv.coefficients, conv.weight.detach())
    expected = vmap(lambda g: pullback(g)[0])(grads)
    got = conv.weight_gradients(grads)
    assert got.shape == expected.shape == grads.shape
    assert _relative(got, expected) < 1e-12
    assert conv.weight_gradients(grads[:0]).shape == (0, *conv.weight.shape)


def test_weight_standardization_standardizes_each_output_field():
    conv = _conv(parse_group("C4"), "regular", 3, 5, weight_standardization=True)
    coefficients = conv.coefficients()
    assert torch.allclose(coefficients.mean(dim=(1, 2)), torch.zeros(5), atol=1e-5)
    assert torch.allclose(coefficients.var(dim=(1, 2), unbiased=False), torch.ones(5), atol=1e-3)


def test_even_group_norm_equals_torch_group_norm():
    norm = FieldGroupNorm(num_fields=6, field_size=8, num_groups=3)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(2, 48, 5, 5)
    expected = F.group_norm(x, 3, norm.weight.repeat_interleave(8), norm.bias.repeat_interleave(8), norm.eps)
    assert torch.allclose(norm(x), expected, atol=1e-5)


def test_uneven_group_norm_handles_an_empty_batch():
    assert FieldGroupNorm(5, 4, 2)(torch.randn(0, 20, 3, 3)).shape == (0, 20, 3, 3)


def test_uneven_group_norm_matches_manual_statistics():
    norm = FieldGroupNorm(num_fields=5, field_size=4, num_groups=2, affine=False)
    x = torch.randn(3, 20, 4, 4) * 3 + 5  # an offset: group statistics are combined from per-field ones
    out = norm(x)
    bounds = [0, 2, 5]  # round(i * 5 / 2): groups of 2 and 3 fields
    for start, stop in zip(bounds, bounds[1:]):
        chunk = x[:, start * 4 : stop * 4]
        mean = chunk.mean(dim=(1, 2, 3), keepdim=True)
        var = chunk.var(dim=(1, 2, 3), keepdim=True, unbiased=False)
        assert torch.allclose(out[:, start * 4 : stop * 4], (chunk - mean) / torch.sqrt(var + norm.eps), atol=1e-5)


@pytest.mark.parametrize("groups", [1, 2, 3, 5])
def test_group_norm_is_equivariant_and_per_sample(groups):
    group = parse_group("D4")
    norm = FieldGroupNorm(5, 8, groups)
    fields = FieldType(group, "regular", 5)
    x = torch.randn(3, 40, 6, 6)
    for g in group.grid_elements:
        assert _relative(norm(act_on_output(g, x, fields)), act_on_output(g, norm(x), fields)) < 1e-6
    other = x.clone()
    other[1:] = torch.randn_like(other[1:]) * 10
    assert torch.equal(norm(other)[0], norm(x)[0])  # sample 0 does not see samples 1, 2


@pytest.mark.parametrize("mode", ["max", "mean", "norm"])
def test_group_pool_is_invariant(mode):
    group = parse_group("D4")
    pool = GroupPool(3, 8, mode)
    fields = FieldType(group, "regular", 3)
    x = torch.randn(2, 24, 5, 5)
    out = pool(x)
    assert out.shape == (2, 3, 5, 5)
    for g in group.grid_elements:
        assert torch.allclose(pool(act_on_output(g, x, fields)), g.act_on_grid(out), atol=1e-6)
    assert pool(torch.randn(2, 24)).shape == (2, 3)


def test_group_pool_rejects_unknown_mode():
    with pytest.raises(ValueError, match="max"):
        GroupPool(3, 8, "median")


@pytest.mark.parametrize("num_fields, num_groups", [(6, 3), (5, 2)], ids=["even", "uneven"])
def test_group_norm_statistics_stay_fp32_under_bf16_autocast(num_fields, num_groups):
    """bf16 activations in, statistics in fp32, the output in the input's dtype: exactly the fp32 result rounded
    once to bf16 (statistics taken in bf16 would be off by far more on activations 3 away from zero)."""
    norm = FieldGroupNorm(num_fields=num_fields, field_size=4, num_groups=num_groups)
    x = (3 + 5 * torch.randn(2, num_fields * 4, 5, 5)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = norm(x)
    assert low.dtype == torch.bfloat16
    assert torch.equal(low, norm(x.float()).bfloat16())


@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_uneven_group_norm_backward_stays_accurate_in_fp32_far_from_zero(offset):
    """The backward expands y = x * r + shift instead of forming y: with activations 100 standard deviations from
    zero (where that expansion cancels most), fp32 still agrees with float64 to 1e-5 of the largest gradient."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 13 * 8, 16, 16, generator=generator, dtype=torch.float64) + offset
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    grads = []
    for dtype in (torch.float64, torch.float32):
        inputs = x.to(dtype).requires_grad_(True)
        norm = FieldGroupNorm(13, 8, 8, affine=False).to(dtype)
        grads.append(torch.autograd.grad((norm(inputs) * upstream.to(dtype)).sum(), inputs)[0].double())
    assert _relative(grads[1], grads[0]) < 1e-5


@pytest.mark.parametrize("num_fields, field_size, num_groups", [(13, 8, 8), (5, 4, 2), (39, 4, 8)])
def test_uneven_group_norm_backward_equals_autograd_of_its_forward(num_fields, field_size, num_groups):
    """FieldGroupNorm's hand-written backward against autograd through the same ops (float64, with eps)."""
    from equiconvert.nn.norm import field_groups, normalize_field_groups

    norm = FieldGroupNorm(
        num_fields, field_size, num_groups, affine=True, eps=1e-2
    ).double()  # a large eps: its term counts
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, num_fields * field_size, 5, 5, generator=generator, dtype=torch.float64) * 2 + 1
    x.requires_grad_(True)
    upstream = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((norm(x) * upstream).sum(), (x, norm.weight, norm.bias))

    reference = x.detach().clone().requires_grad_(True)
    assignment = field_groups(num_fields, num_groups).double()
    fields = reference.reshape(3, num_fields, -1)
    normalized = normalize_field_groups(fields, assignment / assignment.sum(0), assignment.T, norm.eps)
    out = normalized * norm.weight.unsqueeze(-1) + norm.bias.unsqueeze(-1)
    expected = torch.autograd.grad((out.reshape(x.shape) * upstream).sum(), (reference, norm.weight, norm.bias))
    for got, want in zip(grads, expected):
        assert float((got - want).abs().max() / want.abs().max()) < 1e-12
    small = x[:1, :, :2, :2].detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(norm, (small,)) and torch.autograd.gradgradcheck(norm, (small,))


def test_uneven_group_norm_per_sample_gradients_under_torch_func():
    """vmap(grad) through the hand-written backward equals a loop over samples."""
    from torch.func import functional_call, grad, vmap

    norm = FieldGroupNorm(5, 4, 2).double()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    params = {name: p.detach() for name, p in norm.named_parameters()}
    x = torch.randn(4, 20, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss(p, sample):
        return functional_call(norm, p, (sample.unsqueeze(0),)).pow(3).sum()

    batched = vmap(grad(loss), in_dims=(None, 0))(params, x)
    for i in range(4):
        single = grad(loss)(params, x[i])
        for name in params:
            assert torch.allclose(batched[name][i], single[name], rtol=1e-10, atol=1e-12)


def test_uneven_group_norm_output_may_be_overwritten_in_place():
    """An in-place activation after a norm without affine step (a converted ReLU(inplace=True)) keeps backward exact."""
    norm = FieldGroupNorm(5, 4, 2, affine=False).double()
    x = torch.randn(2, 20, 3, 3, dtype=torch.float64, requires_grad=True)
    torch.relu_(norm(x)).sum().backward()
    expected = x.detach().clone().requires_grad_(True)
    torch.relu(norm(expected)).sum().backward()
    assert torch.allclose(x.grad, expected.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled Triton norm kernels)")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_uneven_group_norm_on_cuda_equals_the_torch_path_in_float64(dtype, tolerance):
    """The compiled kernels (tests/nn/fused_norm_interpreted.py checks them interpreted) against float64."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = (3 + 2 * torch.randn(8, 13 * 8, 16, 16, device="cuda", generator=generator)).to(dtype)
    upstream = torch.randn(x.shape, device="cuda", generator=generator)
    norm = FieldGroupNorm(13, 8, 8, affine=False).cuda()
    results = []
    for inputs in (x.clone().requires_grad_(True), x.double().requires_grad_(True)):
        out = norm.to(torch.promote_types(inputs.dtype, torch.float32))(inputs)
        (grad,) = torch.autograd.grad((out * upstream.to(out.dtype)).sum(), inputs)
        results.append((out.double(), grad.double()))
    (out, grad), (expected_out, expected_grad) = results
    assert _relative(out, expected_out) < 1e-5
    assert _relative(grad, expected_grad) < tolerance


def test_a_converted_model_moves_to_channels_last_and_computes_the_same_function():
    """Module.to(memory_format=torch.channels_last) hands every 5-D tensor to .to, which takes that format for 4-D
    tensors only: the steerable convolution's 5-D basis must still move (and keep its values)."""
    import copy

    import equiconvert
    from equiconvert.models import resnet9

    torch.manual_seed(0)
    model = equiconvert.make_equivariant(resnet9(num_classes=10, widths=(8, 16, 32)), "D4", input_size=32).eval()
    images = torch.randn(2, 3, 32, 32)
    expected = model(images)
    moved = copy.deepcopy(model).to(memory_format=torch.channels_last)
    conv = next(m for m in moved.modules() if isinstance(m, SteerableConv2d))
    original = next(m for m in model.modules() if isinstance(m, SteerableConv2d))
    assert conv.basis.dim() == 5 and torch.equal(conv.basis, original.basis)
    assert conv.weight.shape == original.weight.shape
    got = moved(images.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert moved.to(torch.float64)(images.double()).dtype == torch.float64
