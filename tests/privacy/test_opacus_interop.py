"""Opacus interop: per-sample gradients of steerable modules and a real make_private pipeline."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


import equiconvert  # noqa: E402
from equiconvert.models import resnet9  # noqa: E402
from equiconvert.groups import parse_group  # noqa: E402
from equiconvert.nn import FieldGroupNorm, GroupStandardization, SteerableConv2d  # noqa: E402
from equiconvert.privacy import opacus_interop  # noqa: E402,F401  (registers the samplers)
from opacus import GradSampleModule, PrivacyEngine  # noqa: E402
from opacus.grad_sample import GradSampleModuleFastGradientClipping  # noqa: E402
from opacus.validators import ModuleValidator  # noqa: E402

RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


# --- per-layer checks ---------------------------------------------------------------------------


def naive_per_sample(module: nn.Module, x: torch.Tensor, cotangent: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each sample's gradient of <module(x_i), cotangent_i>, one backward pass per sample."""
    grads = []
    for i in range(x.shape[0]):
        module.zero_grad(set_to_none=True)
        (module(x[i : i + 1]) * cotangent[i : i + 1]).sum().backward()
        grads.append({n: p.grad.detach().clone() for n, p in module.named_parameters()})
    module.zero_grad(set_to_none=True)
    return {n: torch.stack([g[n] for g in grads]) for n in grads[0]}


def opacus_per_sample(module: nn.Module, x: torch.Tensor, cotangent: torch.Tensor) -> dict[str, torch.Tensor]:
    # strict=True (Opacus' default) also checks that the layer owns no buffers
    gsm = GradSampleModule(module, loss_reduction="sum", strict=True)
    assert not hasattr(module, "ft_compute_sample_grad"), "Opacus prepared the functorch fallback"
    (gsm(x) * cotangent).sum().backward()
    out = {n: p.grad_sample.detach().clone() for n, p in module.named_parameters()}
    gsm.remove_hooks()
    return out


def check_layer(module: nn.Module, x: torch.Tensor) -> None:
    module = module.double()
    x = x.double()
    assert type(module) in GradSampleModule.GRAD_SAMPLERS
    cotangent = torch.randn_like(module(x))
    expected = naive_per_sample(copy.deepcopy(module), x, cotangent)
    got = opacus_per_sample(module, x, cotangent)
    assert set(got) == set(expected) and expected
    for name in expected:
        assert got[name].shape == expected[name].shape, name
        assert rel_err(got[name], expected[name]) < RTOL, (name, rel_err(got[name], expected[name]))


# a change of basis A of 12 coefficients: the standardization acts on weight @ A (escnn's coordinates in a model)
OTHER_COORDINATES = torch.eye(12) + 0.3 * torch.randn(12, 12, generator=torch.Generator().manual_seed(0))
CONV_CASES = {
    # name: (num_basis, out_size, in_size, in_fields, out_fields, k, kwargs, input H, W)
    "trivial_to_regular": (6, 8, 1, 3, 4, 3, dict(padding=1), (9, 7)),
    "regular_to_regular": (12, 8, 8, 2, 3, 3, dict(padding=1, bias=False), (8, 8)),
    "stride2": (12, 8, 8, 2, 3, 3, dict(padding=1, stride=2), (9, 8)),
    "dilation2": (12, 8, 8, 2, 2, 3, dict(padding=2, dilation=2), (9, 10)),
    "depthwise_per_field": (10, 8, 8, 4, 4, 3, dict(padding=1, groups=4), (7, 8)),
    "depthwise_multiplier2": (10, 8, 8, 3, 6, 3, dict(padding="same", groups=3, bias=False), (8, 7)),
    "reflect": (12, 8, 8, 2, 3, 3, dict(padding=1, padding_mode="reflect"), (8, 9)),
    "reflect_tuple_stride_groups": (
        7,
        4,
        4,
        4,
        2,
        3,
        dict(padding=(1, 2), padding_mode="reflect", stride=2, groups=2),
        (9, 8),
    ),
    "circular_no_bias": (5, 8, 1, 3, 2, 3, dict(padding=1, padding_mode="circular", bias=False), (6, 7)),
    "replicate_dilated": (5, 4, 2, 2, 3, 3, dict(padding=2, dilation=2, padding_mode="replicate"), (8, 8)),
    "mixed_k5": (9, 4, 2, 4, 6, 5, dict(padding=(2, 1), stride=(2, 1), dilation=(1, 2), groups=2), (11, 10)),
    "one_by_one": (3, 8, 8, 3, 5, 1, dict(), (5, 6)),
    "regular_to_trivial_no_padding": (4, 1, 8, 3, 2, 3, dict(), (7, 7)),
    "weight_standardization": (12, 8, 8, 2, 3, 3, dict(padding=1, weight_standardization=True), (8, 8)),
    "weight_standardization_in_other_coordinates": (
        12,
        8,
        8,
        2,
        3,
        3,
        dict(padding=1, weight_standardization="layer", standardization_coordinates=OTHER_COORDINATES),
        (8, 8),
    ),
    "weight_standardization_groups": (
        6,
        4,
        4,
        4,
        4,
        3,
        dict(padding=1, groups=2, weight_standardization=True, bias=False),
        (7, 6),
    ),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_steerable_conv_per_sample_grads_match_naive(case):
    nb, out_size, in_size, in_fields, out_fields, k, kwargs, (h, w) = CONV_CASES[case]
    conv = SteerableConv2d(torch.randn(nb, out_size, in_size, k, k), in_fields, out_fields, **kwargs)
    if conv.bias is not None:
        nn.init.normal_(conv.bias)
    check_layer(conv, torch.randn(5, in_fields * in_size, h, w))


def test_steerable_conv_bias_on_selected_channels():
    conv = SteerableConv2d(torch.randn(5, 4, 3, 3, 3), 2, 3, padding=1, bias_channels=(0, 2))
    nn.init.normal_(conv.bias)
    # strict (make_private's default): `bias_index` is a constant moved by _apply, not a buffer
    check_layer(conv, torch.randn(4, 6, 7, 6))


def test_steerable_conv_chunked_batch(monkeypatch):
    # force one sample per chunk in both the grad sampler and the norm sampler
    monkeypatch.setattr(opacus_interop, "_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(opacus_interop, "_NORM_CHUNK", 2)
    conv = SteerableConv2d(torch.randn(7, 4, 4, 3, 3), 4, 6, padding=1, stride=2, groups=2)
    nn.init.normal_(conv.bias)
    x = torch.randn(5, 16, 9, 8)
    check_layer(conv, x)
    conv, x = conv.double(), x.double()
    backprops = torch.randn_like(conv(x))
    full = opacus_interop.compute_steerable_conv_grad_sample(conv, [x], backprops)
    norms = opacus_interop.compute_steerable_conv_norm_sample(conv, [x], backprops)
    for param in conv.parameters():
        assert rel_err(norms[param], full[param].reshape(5, -1).norm(dim=1)) < RTOL


def test_empty_batch():
    conv = SteerableConv2d(torch.randn(3, 4, 4, 3, 3), 2, 2, padding=1, weight_standardization=True)
    norm = FieldGroupNorm(4, 4, 2)  # even groups: FieldGroupNorm's uneven path cannot run an empty batch
    standardization = GroupStandardization(3, parse_group("O2").layout, 2, affine=True)
    for layer, x in (
        (conv, torch.randn(0, 8, 5, 5)),
        (norm, torch.randn(0, 16, 5, 5)),
        (standardization, torch.randn(0, 27, 5, 5)),
    ):
        backprops = torch.zeros_like(layer(x))
        grads = GradSampleModule.GRAD_SAMPLERS[type(layer)](layer, [x], backprops)
        norms = GradSampleModuleFastGradientClipping.NORM_SAMPLERS[type(layer)](layer, [x], backprops)
        for param in layer.parameters():
            assert grads[param].shape == (0, *param.shape)
            assert norms[param].shape == (0,)


@pytest.mark.parametrize(
    "num_fields,field_size,num_groups",
    [(6, 8, 3), (4, 8, 4), (6, 4, 1), (7, 8, 3), (5, 1, 2), (10, 4, 4)],
)
def test_field_group_norm_per_sample_grads_match_naive(num_fields, field_size, num_groups):
    norm = FieldGroupNorm(num_fields, field_size, num_groups, affine=True)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    check_layer(norm, torch.randn(5, num_fields * field_size, 6, 5) * 3 + 1)


@pytest.mark.parametrize("group,frequency,num_fields,num_groups", [("O2", 1, 6, 3), ("O2", 2, 5, 2), ("SO2", 1, 4, 4)])
def test_group_standardization_per_sample_grads_match_naive(group, frequency, num_fields, num_groups):
    layout = parse_group(group, frequency).layout
    norm = GroupStandardization(num_fields, layout, num_groups, affine=True)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    check_layer(norm, torch.randn(5, num_fields * layout.size, 6, 5) * 3 + 1)


def test_norm_samplers_match_naive_norms():
    conv = SteerableConv2d(torch.randn(6, 4, 4, 3, 3), 4, 2, padding=1, groups=2, weight_standardization=True).double()
    norm = FieldGroupNorm(5, 4, 2).double()
    standardization = GroupStandardization(4, parse_group("O2").layout, 3, affine=True).double()
    with torch.no_grad():
        standardization.bias.normal_()
    for layer, x in (
        (conv, torch.randn(3, 16, 6, 6)),
        (norm, torch.randn(3, 20, 4, 4)),
        (standardization, torch.randn(3, 36, 5, 4)),
    ):
        x = x.double()
        backprops = torch.randn_like(layer(x))
        expected = naive_per_sample(copy.deepcopy(layer), x, backprops)
        sampler = GradSampleModuleFastGradientClipping.NORM_SAMPLERS[type(layer)]
        norms = {p: v for p, v in sampler(layer, [x], backprops).items()}
        for name, param in layer.named_parameters():
            want = expected[name].reshape(3, -1).norm(dim=1)
            assert rel_err(norms[param], want) < RTOL, name


def test_import_has_no_side_effects_beyond_registration():
    code = (
        "import opacus.grad_sample as gs\n"
        "from opacus.validators import ModuleValidator\n"
        "from opacus.grad_sample import GradSampleModule, GradSampleModuleFastGradientClipping as FGC\n"
        "before = (set(GradSampleModule.GRAD_SAMPLERS), set(FGC.NORM_SAMPLERS), dict(ModuleValidator.VALIDATORS))\n"
        "import equiconvert.privacy.opacus_interop\n"
        "from equiconvert.nn import SteerableConv2d, FieldGroupNorm, GroupStandardization\n"
        "new = {SteerableConv2d, FieldGroupNorm, GroupStandardization}\n"
        "assert set(GradSampleModule.GRAD_SAMPLERS) - before[0] == new\n"
        "assert set(FGC.NORM_SAMPLERS) - before[1] == new\n"
        "assert dict(ModuleValidator.VALIDATORS) == before[2]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


def test_missing_opacus_gives_clear_import_error():
    code = (
        "import sys; sys.modules['opacus'] = None\n"
        "try:\n"
        "    import equiconvert.privacy.opacus_interop\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "needs Opacus" in result.stdout and "pip install" in result.stdout


# --- the converted ResNet9 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted() -> nn.Module:
    torch.manual_seed(0)
    model = equiconvert.make_equivariant(
        resnet9(widths=(16, 32, 64), num_classes=10), "D4", head="invariant", input_size=32
    )
    return model.train()


@pytest.fixture
def model(converted) -> nn.Module:
    return copy.deepcopy(converted)


def test_converted_model_passes_module_validator(model):
    assert ModuleValidator.validate(model, strict=True) == []
    types = {type(m) for m in model.modules()}
    assert SteerableConv2d in types and FieldGroupNorm in types


def _train_private(module_for_engine: nn.Module, model: nn.Module, steps_wanted: int = 3) -> None:
    torch.manual_seed(1)
    images, labels = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    loader = DataLoader(TensorDataset(images, labels), batch_size=16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = PrivacyEngine()
    dp_model, optimizer, dp_loader = engine.make_private(
        module=module_for_engine,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    # every trainable layer of the converted model is handled by a registered hook sampler
    assert not any(hasattr(m, "ft_compute_sample_grad") for m in model.modules())
    steps = 0
    for x, y in dp_loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(dp_model(x), y)
        loss.backward()
        optimizer.step()
        assert math.isfinite(loss.item())
        steps += 1
        if steps == steps_wanted:
            break
    assert steps == steps_wanted
    for name, param in model.named_parameters():
        assert not torch.equal(param.detach(), before[name]), f"{name} did not change"
    epsilon = engine.get_epsilon(1e-5)
    assert 0 < epsilon < math.inf


def test_make_private_with_default_arguments(model):
    _train_private(model, model)


def test_make_private_on_prewrapped_module(model):
    # Opacus also accepts an already wrapped GradSampleModule
    _train_private(GradSampleModule(model), model)


def _exact_per_sample(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(p, xi, yi):
        logits = torch.func.functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)


def _assert_opacus_per_sample_grads_match_vmap(model: nn.Module) -> dict[str, float]:
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    expected = _exact_per_sample(model, x, y)
    gsm = GradSampleModule(model)
    F.cross_entropy(gsm(x), y).backward()  # loss_reduction="mean", as make_private's default
    errors = {}
    for name, param in model.named_parameters():
        assert param.grad_sample is not None, name
        errors[name] = rel_err(param.grad_sample, expected[name])
        assert errors[name] < RTOL, (name, errors[name])
    gsm.remove_hooks()
    return errors


def _channels_last_cnn() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1)]
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)]
    return nn.Sequential(*layers, *head).to(memory_format=torch.channels_last)


def test_make_private_gives_channels_last_models_exact_per_sample_conv_gradients():
    """Opacus' own Conv2d sampler misreads a channels-last input; make_private gives each Conv2d a contiguous one."""
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    y = torch.arange(4)
    plain = _channels_last_cnn()
    expected = _exact_per_sample(plain, x, y)
    gsm = GradSampleModule(plain)
    F.cross_entropy(gsm(x), y).backward()
    assert rel_err(plain[0].weight.grad_sample, expected["0.weight"]) > 0.1  # Opacus alone: wrong
    gsm.remove_hooks()

    model = _channels_last_cnn()
    with pytest.warns(UserWarning, match="secure_mode"):
        private, _, _ = opacus_interop.make_private(
            PrivacyEngine(),
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    F.cross_entropy(private(x), y).backward()
    for name, param in model.named_parameters():
        assert rel_err(param.grad_sample, expected[name]) < RTOL, name
    assert model[3].weight.is_contiguous(memory_format=torch.channels_last)  # the model keeps its layout


def test_resnet9_per_sample_grads_match_vmap(model):
    _assert_opacus_per_sample_grads_match_vmap(model)


@pytest.fixture
def o2_model() -> nn.Module:
    """A whole O(2) ResNet9: gated fields, GroupStandardization (affine), norm max pooling, invariant map."""
    torch.manual_seed(0)
    model = equiconvert.make_equivariant(
        resnet9(num_classes=10, widths=(8, 16, 32)), "O2", head="invariant", input_size=32
    ).train()
    assert GroupStandardization in {type(m) for m in model.modules()}
    return model


def test_o2_resnet9_make_private_with_default_arguments_trains_two_steps(o2_model):
    _train_private(o2_model, o2_model, steps_wanted=2)


def test_o2_resnet9_opacus_per_sample_grads_match_vmap(o2_model):
    errors = _assert_opacus_per_sample_grads_match_vmap(o2_model)
    print(
        f"O2 resnet9: Opacus vs torch.func per-sample gradients, max relative error {max(errors.values()):.1e} "
        f"over {len(errors)} parameters"
    )


def test_functorch_mode_per_sample_grads_match_vmap(model):
    # not the default path (our hook samplers are), but Opacus' grad_sample_mode="functorch" must not lie either
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    expected = _exact_per_sample(model, x, y)
    gsm = GradSampleModule(model, force_functorch=True)
    F.cross_entropy(gsm(x), y).backward()
    for name, param in model.named_parameters():
        err = rel_err(param.grad_sample, expected[name])
        assert err < RTOL, (name, err)


def test_every_parameter_gets_a_grad_sample(model):
    gsm = GradSampleModule(model)
    x, y = torch.randn(3, 3, 32, 32), torch.randint(0, 10, (3,))
    F.cross_entropy(gsm(x), y).backward()
    params = list(model.named_parameters())
    assert params
    for name, param in params:
        assert param.grad_sample is not None, f"{name} got no grad_sample"
        assert param.grad_sample.shape == (3, *param.shape), name
        assert torch.isfinite(param.grad_sample).all(), name
    # every trainable module has a registered hook sampler, none goes through the functorch fallback
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            assert type(module) in GradSampleModule.GRAD_SAMPLERS, name
            assert not hasattr(module, "ft_compute_sample_grad"), name
    # and no parameter-free module mixes samples (what per-sample clipping could not see)
    with torch.no_grad():
        together = model(x)
        alone = torch.cat([model(x[i : i + 1]) for i in range(3)])
    assert rel_err(together, alone) < RTOL


def test_ghost_clipping_norms_match_exact(model):
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    expected = _exact_per_sample(model, x, y)
    exact_norms = torch.stack([g.reshape(4, -1).pow(2).sum(1) for g in expected.values()]).sum(0).sqrt()
    gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True, loss_reduction="sum")
    F.cross_entropy(gsm(x), y, reduction="sum").backward()
    assert rel_err(gsm.get_norm_sample(), exact_norms) < RTOL
