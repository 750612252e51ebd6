"""FieldGroupNormMaxPool2d equals FieldGroupNorm then the window max pool; fuse_norm_pools fuses the pair on request;
export splits it."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from equiconvert.convert import fuse_norm_pools
from equiconvert.errors import ParameterError
from equiconvert.export import export
from equiconvert.models import equivariant_resnet9
from equiconvert.nn import FieldGroupNorm, FieldGroupNormMaxPool2d, WindowMaxPool2d


def _pair(norm: FieldGroupNorm, kernel: int) -> nn.Module:
    return nn.Sequential(norm, WindowMaxPool2d(kernel))


def _value_and_grad(layer: nn.Module, x: torch.Tensor, upstream: torch.Tensor):
    inputs = x.clone().requires_grad_(True)
    out = layer(inputs)
    (grad,) = torch.autograd.grad((out * upstream.to(out.dtype)).sum(), inputs)
    return out, grad


@pytest.mark.parametrize(
    "num_fields, field_size, num_groups, size",
    [(6, 8, 6, 8), (13, 8, 8, 8), (39, 4, 8, 6), (5, 1, 2, 7)],  # even, uneven, restricted, odd size (a row left out)
)
def test_fused_equals_norm_then_pool_in_float64(num_fields, field_size, num_groups, size):
    norm = FieldGroupNorm(num_fields, field_size, num_groups, affine=False).double()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, num_fields * field_size, size, size, generator=generator, dtype=torch.float64) * 3 + 1
    upstream = torch.randn(3, num_fields * field_size, size // 2, size // 2, generator=generator, dtype=torch.float64)
    fused_out, fused_grad = _value_and_grad(FieldGroupNormMaxPool2d(norm, 2), x, upstream)
    out, grad = _value_and_grad(_pair(norm, 2), x, upstream)
    torch.testing.assert_close(fused_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused_grad, grad, rtol=1e-10, atol=1e-12)


def test_bf16_in_bf16_out_as_the_pair_computes_it():
    norm = FieldGroupNorm(13, 8, 8, affine=False)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 104, 8, 8, generator=generator).bfloat16()
    upstream = torch.randn(2, 104, 4, 4, generator=generator)
    out, grad = _value_and_grad(FieldGroupNormMaxPool2d(norm, 2), x, upstream)
    pair_out, pair_grad = _value_and_grad(_pair(norm, 2), x, upstream)
    assert out.dtype == grad.dtype == torch.bfloat16
    torch.testing.assert_close(out, pair_out, rtol=0, atol=0)  # the same fp32 statistics and one rounding
    # bf16 rounding can tie two elements of a window in the pair's normalized tensor but not in x, and the pool then
    # routes the gradient to the other one; each window's gradient sum is the same either way
    window_sums, pair_window_sums = (torch.nn.functional.avg_pool2d(g.double(), 2) for g in (grad, pair_grad))
    assert (window_sums - pair_window_sums).abs().max() < 2e-2 * pair_window_sums.abs().max()
    assert (grad == pair_grad).float().mean() > 0.95


def test_under_torch_func_the_two_layers_run_and_agree():
    norm = FieldGroupNorm(6, 4, 3, affine=False)
    fused, pair = FieldGroupNormMaxPool2d(norm, 2), _pair(norm, 2)
    x = torch.randn(4, 24, 6, 6, generator=torch.Generator().manual_seed(2))

    def loss(layer):
        return lambda example: layer(example.unsqueeze(0)).pow(2).sum()

    per_example = torch.func.vmap(torch.func.grad(loss(fused)))(x)
    torch.testing.assert_close(per_example, torch.func.vmap(torch.func.grad(loss(pair)))(x))


def test_a_norm_with_affine_parameters_is_refused():
    with pytest.raises(ParameterError, match="without affine parameters"):
        FieldGroupNormMaxPool2d(FieldGroupNorm(4, 2, 2, affine=True), 2)


class _LeafTracer(fx.Tracer):
    """Keeps the two layers as calls, as conversion's tracer does."""

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return isinstance(m, (FieldGroupNorm, WindowMaxPool2d)) or super().is_leaf_module(m, qualified_name)


class _NormPool(nn.Module):
    def __init__(self, affine: bool, second_user: bool):
        super().__init__()
        self.norm = FieldGroupNorm(4, 2, 2, affine=affine)
        self.pool = WindowMaxPool2d(2)
        self.second_user = second_user

    def forward(self, x):
        y = self.norm(x)
        return self.pool(y) + y[..., ::2, ::2] if self.second_user else self.pool(y)


@pytest.mark.parametrize("affine, second_user, fused", [(False, False, 1), (True, False, 0), (False, True, 0)])
def test_only_an_affine_free_norm_feeding_only_the_pool_is_fused(affine, second_user, fused):
    module = _NormPool(affine, second_user)
    graph = _LeafTracer().trace(module)
    gm = fx.GraphModule(module, graph)
    x = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    before = gm.double()(x)
    assert fuse_norm_pools(gm) == fused
    assert sum(isinstance(m, FieldGroupNormMaxPool2d) for m in gm.modules()) == fused
    torch.testing.assert_close(gm(x), before, rtol=1e-12, atol=1e-12)


def test_conversion_does_not_fuse_and_fuse_norm_pools_fuses_the_paper_model_which_exports_to_norm_then_max_pool():
    model = equivariant_resnet9("D4").double().eval()
    assert not any(isinstance(m, FieldGroupNormMaxPool2d) for m in model.modules())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        unfused_out = model(x)
    assert fuse_norm_pools(model) == 3
    fused = [name for name, m in model.named_modules() if isinstance(m, FieldGroupNormMaxPool2d)]
    assert [name.rsplit(".", 2)[-2:] for name in fused] == [["layer1", "3"], ["layer2", "3"], ["layer3", "3"]]
    assert model.state_dict().keys() == equivariant_resnet9("D4").state_dict().keys()  # the fusion adds no state
    with torch.no_grad():
        torch.testing.assert_close(model(x), unfused_out, rtol=1e-9, atol=1e-9)
    exported = export(model)
    assert not any(isinstance(m, (FieldGroupNormMaxPool2d, FieldGroupNorm)) for m in exported.modules())
    assert sum(type(m) is nn.MaxPool2d for m in exported.modules()) >= 3
    with torch.no_grad():
        torch.testing.assert_close(exported(x), model(x), rtol=1e-9, atol=1e-9)


def test_the_fuse_norm_pools_option_fuses_at_conversion_and_the_report_counts_the_pairs():
    unfused = equivariant_resnet9("D4").double().eval()
    fused = equivariant_resnet9("D4", fuse_norm_pools=True).double().eval()
    assert fused.report.fused_norm_pools == 3 and unfused.report.fused_norm_pools == 0
    assert "fused norm -> max pool pairs: 3" in str(fused.report)
    assert sum(isinstance(m, FieldGroupNormMaxPool2d) for m in fused.modules()) == 3
    fused.load_state_dict(unfused.state_dict())  # the same parameters under the same names
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), unfused(x), rtol=1e-9, atol=1e-9)


def test_fuse_norm_pools_refuses_a_model_with_no_traced_graph():
    with pytest.raises(ParameterError, match="fuse_norm_pools: Sequential holds no torch.fx GraphModule"):
        fuse_norm_pools(nn.Sequential(FieldGroupNorm(4, 2, 2), WindowMaxPool2d(2)))
