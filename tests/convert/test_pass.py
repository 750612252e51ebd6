"""The conversion pass: rules, widths, grid analysis, diagnostics and run-time properties."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torchvision.models.resnet import Bottleneck, ResNet
from torch import nn

import equiconvert
from equiconvert import EquivarianceBreakError, TracingError, UnsupportedLayerError
from equiconvert.models import resnet9
from equiconvert.nn import FieldGroupNorm, GroupPool, SteerableConv2d


def _convs(model):
    return [m for m in model.modules() if isinstance(m, SteerableConv2d)]


# --- width policies -------------------------------------------------------------------------


@pytest.mark.parametrize("width,first_fields", [(None, 29), (1.5, 27), ("channels", 8), (lambda c, g: c // 16, 4)])
def test_width_policies_on_resnet9(width, first_fields):
    # 64 channels, |G| = 8: floor(64 sqrt(1.75*8)/8) = 29, floor(64 sqrt(1.5*8)/8) = 27, 64/8 = 8
    model = equiconvert.make_equivariant(resnet9(), "D4", width=width, head="invariant")
    assert _convs(model)[0].out_fields == first_fields


@pytest.mark.parametrize("factory", [resnet9, lambda: torchvision.models.resnet18(num_classes=10)])
def test_width_params_matches_parameter_count_within_2_percent(factory):
    model = equiconvert.make_equivariant(factory(), "D4", width="params")
    before, after = model.report.params_before, model.report.params_after
    assert abs(after - before) <= 0.02 * before, (before, after)


def test_fields_stay_consistent_across_densenet_concatenations():
    model = equiconvert.make_equivariant(torchvision.models.densenet121(num_classes=10), "C4", input_size=61)
    cats = [n for n in model.network.graph.nodes if n.target is torch.cat]
    assert len(cats) > 50
    for node in cats:
        parts = node.meta["equiconvert_type"].num_fields
        assert parts == sum(a.meta["equiconvert_type"].num_fields for a in node.args[0])
    assert model.report.input_size_valid


def test_grouped_convs_get_field_counts_divisible_by_groups():
    resnext = ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, groups=32, width_per_group=4)  # resnext50_32x4d's blocks
    model = equiconvert.make_equivariant(resnext, "C4", input_size=33)
    grouped = [c for c in _convs(model) if 1 < c.groups < c.in_fields]
    assert grouped and all(c.in_fields % 32 == 0 and c.out_fields % 32 == 0 for c in grouped)
    assert equiconvert.check_equivariance(model).max_error <= 1e-5


# --- grid symmetry ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnet18_c4():
    """One C4 conversion of resnet18 for the tests that only read it (its report, its outputs)."""
    torch.manual_seed(0)
    return equiconvert.make_equivariant(torchvision.models.resnet18(num_classes=10), "C4", input_size=225)


def test_valid_input_sizes_of_resnet18_and_vgg(resnet18_c4):
    resnet = resnet18_c4
    assert resnet.report.valid_input_sizes[:3] == [33, 65, 97]  # five stride-2 stages: 32k + 1
    assert resnet.report.input_size_valid is True
    assert "1 mod 32" in resnet.report.valid_input_rule
    vgg = equiconvert.make_equivariant(torchvision.models.vgg11(num_classes=10), "C4", head="invariant", input_size=224)
    assert vgg.report.input_size_valid and vgg.report.valid_input_sizes[:2] == [32, 64]  # five 2x2 pools


def test_invalid_size_really_breaks_equivariance_and_valid_size_does_not(resnet18_c4):
    model = resnet18_c4
    assert equiconvert.check_equivariance(model, input_size=33).max_error <= 1e-5
    assert equiconvert.check_equivariance(model, input_size=32).max_error > 1e-3


def test_resnet_d_avgpool_shortcut_is_rewritten_symmetrically():
    import timm

    resnet_d = timm.create_model("resnet50d", num_classes=10, layers=(1, 1, 1, 1))  # one block a stage suffices
    model = equiconvert.make_equivariant(resnet_d, "C4", input_size=33)
    pools = [c for c in model.report.layers if c.before.startswith("AvgPool2d(kernel_size=2")]
    assert len(pools) == 3 and all("kernel_size=3" in c.after for c in pools)
    assert model.report.input_size_valid


# --- heads and diagnostics ---------------------------------------------------------------------


def test_spatial_flatten_head_is_reported_with_location():
    model = equiconvert.make_equivariant(resnet9(), "D4", input_size=32, head="keep")
    assert not model.report.invariant_output
    (warning,) = model.report.warnings
    assert warning.module_path.startswith("head") and "not invariant" in warning.message
    assert "resnet9.py:" in warning.source
    assert equiconvert.check_equivariance(model).max_error > 1e-3  # and it really is not invariant


def test_strict_turns_warnings_into_errors():
    with pytest.raises(EquivarianceBreakError, match="head"):
        equiconvert.make_equivariant(resnet9(), "D4", strict=True, head="keep")


def test_invariant_head_pools_globally():
    model = equiconvert.make_equivariant(resnet9(), "D4", head="invariant")
    linear = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    pool = [m for m in model.modules() if isinstance(m, GroupPool)]
    assert len(pool) == 1 and linear.in_features == pool[0].num_fields
    assert model.report.invariant_output


class _Functional(nn.Module):
    """Functional and in-place forms, a spatial mean head and a view head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.norm = nn.InstanceNorm2d(16, affine=True)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = F.relu(self.conv1(x), inplace=True)
        y = self.act(self.norm(self.conv2(x)))
        y += x
        y = torch.sigmoid(y).relu_() * y
        y = F.max_pool2d(y, 3, 2, 1)
        y = y.mean((2, 3), keepdim=True)
        return self.fc(y.view(y.size(0), -1))


def test_functional_inplace_and_view_forms_convert():
    model = equiconvert.make_equivariant(_Functional(), "D4", input_size=17)
    targets = {str(getattr(n.target, "__name__", n.target)) for n in model.network.graph.nodes}
    assert not {"relu_", "iadd"} & targets
    assert all(not n.kwargs.get("inplace") for n in model.network.graph.nodes)
    assert not any(getattr(m, "inplace", False) for m in model.modules())
    assert model.report.invariant_output and model.report.input_size_valid
    assert equiconvert.check_equivariance(model, input_size=17).max_error <= 1e-5


def test_classifier_conv_becomes_invariant_logits():
    squeeze = torchvision.models.squeezenet1_1(num_classes=10)
    model = equiconvert.make_equivariant(squeeze, "D4", input_size=47)
    assert _convs(model)[-1].out_size == 1 and _convs(model)[-1].out_fields == 10
    assert model(torch.randn(2, 3, 47, 47)).shape == (2, 10)
    assert equiconvert.check_equivariance(model).max_error <= 1e-5


class _EvenKernel(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 4, stride=4)

    def forward(self, x):
        return self.stem(x)


class _WithLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.ln = nn.LayerNorm([8, 30, 30])

    def forward(self, x):
        return self.ln(self.conv(x))


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _DataDependent()

    def forward(self, x):
        return self.inner(x)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        return self.conv(x) if x.sum() > 0 else x


def test_even_kernel_raises_naming_node():
    with pytest.raises(UnsupportedLayerError, match=r"'stem'.*even kernel_size=4"):
        equiconvert.make_equivariant(_EvenKernel(), "C4", input_size=32)


def test_unsupported_module_names_module_and_options():
    with pytest.raises(UnsupportedLayerError, match=r"LayerNorm.*module 'ln'.*Options"):
        equiconvert.make_equivariant(_WithLayerNorm(), "C4", input_size=32)


def test_channel_shuffle_is_refused():
    with pytest.raises(UnsupportedLayerError, match="splits fields"):
        equiconvert.make_equivariant(torchvision.models.shufflenet_v2_x0_5(num_classes=10), "C4", input_size=33)


def test_untraceable_model_names_the_module_and_leaf_option():
    with pytest.raises(TracingError, match=r"'inner' \(_DataDependent\).*leaf_modules"):
        equiconvert.make_equivariant(_Untraceable(), "C4", input_size=32)


def test_asymmetric_padding_is_flagged():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=(1, 0)))
    converted = equiconvert.make_equivariant(model, "C4", input_size=16)
    assert any("padding=(1, 0)" in w.message for w in converted.report.warnings)
    with pytest.raises(EquivarianceBreakError):
        equiconvert.make_equivariant(model, "C4", input_size=16, strict=True)


def test_bad_options_raise_early():
    with pytest.raises(ValueError, match="unknown config keys"):
        equiconvert.make_equivariant(resnet9(), "D4", config={"hed": "invariant"})
    with pytest.raises(ValueError, match="head"):
        equiconvert.make_equivariant(resnet9(), "D4", head="global")
    with pytest.raises(ValueError, match="width"):
        equiconvert.make_equivariant(resnet9(), "D4", width="wide")


# --- run-time properties ---------------------------------------------------------------------


def test_no_batch_statistics_and_original_untouched():
    original = torchvision.models.resnet18(num_classes=10)
    state = copy.deepcopy(original.state_dict())
    model = equiconvert.make_equivariant(original, "D4")
    assert any(isinstance(m, FieldGroupNorm) for m in model.modules())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    original_ids = {id(p) for p in original.parameters()}
    assert not original_ids & {id(p) for p in model.parameters()}
    assert all(torch.equal(state[k], v) for k, v in original.state_dict().items())


def test_training_mode_is_preserved():
    model = resnet9()
    model.train()
    assert equiconvert.make_equivariant(model, "C4", head="invariant").training
    model.eval()
    assert not equiconvert.make_equivariant(model, "C4", head="invariant").training


def test_to_moves_basis_buffers():
    model = equiconvert.make_equivariant(resnet9(widths=(16, 32, 64)), "C4", head="invariant")
    model.to(torch.float64)
    assert all(c.basis.dtype == torch.float64 for c in _convs(model))
    out = model(torch.randn(2, 3, 32, 32, dtype=torch.float64))
    assert out.dtype == torch.float64
    model.to("meta")  # parameters go; constants stay (Opacus' functorch mode swaps real parameters into a meta copy)
    assert all(c.weight.is_meta and not c.basis.is_meta for c in _convs(model))


def test_torch_func_per_sample_gradients_match_naive_loop():
    from torch.func import functional_call, grad, vmap

    model = equiconvert.make_equivariant(resnet9(), "D4", head="invariant").eval()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([1, 4, 7])

    def loss(p, xi, yi):
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(out, yi.unsqueeze(0))

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)  # plain torch.func, as users call it
    for i in range(3):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in model.named_parameters():
            reference = p.grad
            error = (per_sample[name][i] - reference).abs().max() / reference.abs().max().clamp_min(1e-12)
            assert error <= 1e-5, (name, float(error))
