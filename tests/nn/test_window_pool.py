"""WindowMaxPool2d: max_pool2d's values and gradients, bit for bit, through its scatter backward."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equiconvert
from equiconvert.export import export
from equiconvert.nn import WindowMaxPool2d
from equiconvert.nn import window_pool


def _value_and_grad(pool, x, upstream):
    x = x.detach().clone().requires_grad_(True)
    out = pool(x)
    out.backward(upstream)
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel, size", [(2, 8), (3, 9), (2, 7)])  # 7: the last row and column fall outside
def test_values_and_gradients_equal_max_pool2d(dtype, kernel, size):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, size, size, generator=generator).to(dtype)
    x[0, 0] = 1.0  # ties everywhere in one channel: max_pool2d's choice of index is kept
    upstream = torch.randn(F.max_pool2d(x, kernel).shape, generator=generator).to(dtype)
    out, grad = _value_and_grad(WindowMaxPool2d(kernel), x, upstream)
    expected_out, expected_grad = _value_and_grad(nn.MaxPool2d(kernel), x, upstream)
    assert torch.equal(out, expected_out)
    assert torch.equal(grad, expected_grad)
    assert grad.dtype == dtype


@pytest.mark.parametrize(
    "x",
    [torch.randn(5, 6, 6), torch.randn(2, 5, 6, 6).to(memory_format=torch.channels_last)],
    ids=["unbatched", "nhwc"],
)
def test_unbatched_and_channels_last_inputs_equal_max_pool2d(x):
    upstream = torch.randn(F.max_pool2d(x, 2).shape)
    out, grad = _value_and_grad(WindowMaxPool2d(2), x, upstream)
    expected_out, expected_grad = _value_and_grad(nn.MaxPool2d(2), x, upstream)
    assert torch.equal(out, expected_out) and torch.equal(grad, expected_grad)


def test_the_scatter_backward_runs_when_a_gradient_is_needed():
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    assert "_WindowMaxPool" in type(WindowMaxPool2d(2)(x).grad_fn).__name__
    with torch.no_grad():
        assert WindowMaxPool2d(2)(x).grad_fn is None


def test_second_derivatives_equal_max_pool2d():
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)

    def grad_norm(pool):
        (grad,) = torch.autograd.grad(pool(x).pow(3).sum(), x, create_graph=True)
        return torch.autograd.grad(grad.pow(2).sum(), x)[0]

    assert torch.allclose(grad_norm(WindowMaxPool2d(2)), grad_norm(nn.MaxPool2d(2)))


def test_per_sample_gradients_under_vmap_equal_a_loop():
    """torch.func gets plain max_pool2d; the per-sample gradients equal one backward per sample."""
    conv = nn.Conv2d(2, 3, 3, padding=1)
    pool = WindowMaxPool2d(2)
    x = torch.randn(4, 2, 6, 6)
    params = {k: v.detach() for k, v in conv.named_parameters()}

    def loss(params, sample):
        return pool(torch.func.functional_call(conv, params, (sample[None],))).pow(2).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i, sample in enumerate(x):
        conv.zero_grad()
        pool(conv(sample[None])).pow(2).sum().backward()
        assert torch.allclose(per_sample["weight"][i], conv.weight.grad, atol=1e-6)


def test_conversion_uses_it_for_tiling_max_pools_only():
    source = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.MaxPool2d(3, 2, 1)
    )
    model = equiconvert.make_equivariant(source, group="C4", input_size=18)
    pools = [type(m) for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    assert pools == [WindowMaxPool2d, nn.MaxPool2d]  # the overlapping 3x3 stride-2 window keeps max_pool2d


def test_traced_models_call_it_as_a_function():
    traced = torch.fx.symbolic_trace(nn.Sequential(WindowMaxPool2d(2)))
    assert [n.target for n in traced.graph.nodes if n.op == "call_function"] == [window_pool.window_max_pool2d]


def test_export_gives_the_plain_max_pool():
    exported = export(nn.Sequential(WindowMaxPool2d(2)))
    assert type(exported[0]) is nn.MaxPool2d
    assert (exported[0].kernel_size, exported[0].stride) == (2, 2)
