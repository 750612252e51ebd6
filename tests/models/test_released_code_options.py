"""The options that give the paper preset the released code's choices (hlzl/equivariant) and the identity that
expresses its sum of view gradients with our mean: each does what it says, and the model stays exactly equivariant."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import equiconvert
from equiconvert.convert.norm_groups import NORM_GROUP_RULES, norm_group_rule
from equiconvert.groups import parse_group
from equiconvert.models import equivariant_resnet9
from equiconvert.nn import FieldGroupNorm, SteerableConv2d
from equiconvert.nn.conv import standardization_scope
from equiconvert.training.trainer import DPTrainer

RELEASED = {"weight_standardization": "layer", "norm_group_rule": "released"}
STAGES = ("stem", "layer1", "res1", "layer2", "layer3", "res2")


def _stage_groups(model: nn.Module) -> dict[str, set[int]]:
    groups: dict[str, set[int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FieldGroupNorm):
            stage = next(s for s in STAGES if f".{s}." in f".{name}.")
            groups.setdefault(stage, set()).add(module.num_groups)
    return groups


def test_released_rule_gives_the_released_codes_groups():
    rule = norm_group_rule("released")
    # 8 asked: divisors of the field count nearest to 8 that leave more than 3 fields a group, else one group
    assert [rule(fields, 8) for fields in (6, 13, 27, 39, 16, 54, 12, 1)] == [1, 1, 3, 3, 8, 9, 1, 1]
    assert [norm_group_rule("at_most")(fields, 8) for fields in (6, 13, 39)] == [6, 8, 8]
    assert set(NORM_GROUP_RULES) == {"at_most", "released"}
    with pytest.raises(ValueError, match="norm_group_rule must be one of"):
        norm_group_rule("nearest")
    plain_convs = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())  # no norm: refused before any layer converts
    with pytest.raises(ValueError, match="norm_group_rule must be one of"):
        equiconvert.make_equivariant(plain_convs, "C4", config={"norm_group_rule": "nearest"})
    with pytest.raises(ValueError, match="weight_standardization must be a bool or one of"):
        equiconvert.make_equivariant(plain_convs, "C4", config={"weight_standardization": "channel"})


def test_the_released_options_give_1_1_3_3_groups_and_whole_layer_standardization():
    ours = equivariant_resnet9("D4")
    released = equivariant_resnet9("D4", **RELEASED)
    assert _stage_groups(ours) == {"stem": {6}, "layer1": {8}, "res1": {8}, "layer2": {8}, "layer3": {8}, "res2": {8}}
    assert _stage_groups(released) == {
        "stem": {1},
        "layer1": {1},
        "res1": {1},
        "layer2": {3},
        "layer3": {3},
        "res2": {3},
    }
    convs = [m for m in released.modules() if isinstance(m, SteerableConv2d)]
    assert convs and {c.weight_standardization for c in convs} == {"layer"}
    assert {c.weight_standardization for c in ours.modules() if isinstance(c, SteerableConv2d)} == {"field"}
    assert sum(p.numel() for p in released.parameters()) == 255_675  # Table 1: the options add no parameters


def test_the_released_options_keep_the_model_exactly_equivariant():
    model = equivariant_resnet9("D4", head="invariant", **RELEASED).eval()
    result = equiconvert.check_equivariance(model)
    assert result.max_error < 1e-5, result.errors


def _conv(scope, dtype=torch.float32) -> SteerableConv2d:
    from equiconvert.basis import steerable_basis

    basis = steerable_basis(parse_group("C4"), "regular", "regular", 3)
    conv = SteerableConv2d(basis, 3, 5, padding=1, weight_standardization=scope).to(dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # fields of different scales and offsets, so the two scopes differ
        scale = torch.linspace(0.2, 2.0, 5, dtype=dtype)[:, None, None]
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator, dtype=dtype) * scale + scale)
    return conv


def test_layer_scope_standardizes_the_whole_coefficient_vector_not_each_field():
    conv = _conv("layer", torch.float64)
    weight = conv.weight.detach()
    expected = (weight - weight.mean()) / (weight.std(unbiased=False) + conv.eps)  # eps added to the std
    assert torch.allclose(conv.coefficients(), expected, rtol=0, atol=1e-14)
    coefficients = conv.coefficients().detach()
    assert abs(float(coefficients.mean())) < 1e-12 and abs(float(coefficients.std(unbiased=False)) - 1) < 1e-4
    per_field_std = coefficients.std(dim=(1, 2), unbiased=False)
    assert float(per_field_std.max() / per_field_std.min()) > 3  # the fields keep their relative scales
    field = _conv(True, torch.float64).coefficients()
    assert torch.allclose(field.std(dim=(1, 2), unbiased=False), torch.ones(5, dtype=torch.float64), atol=1e-3)


def test_layer_scope_weight_gradients_equal_autograds_vjp():
    from torch.func import vjp, vmap

    conv = _conv("layer", torch.float64)
    grads = torch.randn(4, *conv.weight.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, pullback = vjp(conv.coefficients, conv.weight.detach())
    expected = vmap(lambda g: pullback(g)[0])(grads)
    got = conv.weight_gradients(grads)
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-12


def test_standardization_scope_names_and_refusals():
    assert [standardization_scope(v) for v in (False, None, True, "field", "layer")] == [
        None,
        None,
        "field",
        "field",
        "layer",
    ]
    with pytest.raises(ValueError, match="weight_standardization must be a bool or one of"):
        standardization_scope("channel")
    # the recorded architecture (OUT/model.txt, compared on resume) reads as before for the existing scopes
    assert "weight_standardization=True" in repr(_conv(True)) and "weight_standardization=False" in repr(_conv(False))
    assert "weight_standardization='layer'" in repr(_conv("layer"))


class _Fixed:
    """A noise source drawing the same unit normals for every run, scaled by the std asked."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(7)

    def gaussian(self, shape, std, dtype=torch.float32):
        return torch.randn(tuple(shape), generator=self.generator, dtype=dtype) * std


def _fixed_views(images: torch.Tensor, views: int, generator) -> torch.Tensor:
    """K deterministic views (the image, then shifted copies), so both computations see the same ones."""
    return torch.stack([images.roll(k, dims=-1) * (1 + 0.1 * k) for k in range(views)], dim=1)


@pytest.mark.filterwarnings("ignore:insecure_seeded_noise")
def test_summing_views_before_clipping_at_c_equals_averaging_and_clipping_at_c_over_k_with_k_times_the_lr():
    """The released code sums each example's K view gradients, clips at C, adds N(0, (sigma C)^2) and divides by
    its batch B; our trainer averages them, so clip C/K, the same sigma and lr x K give the same step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    images, labels = torch.randn(6, 1, 6, 6), torch.tensor([0, 1, 2, 0, 1, 2])
    views, clip, sigma, lr, batch = 4, 0.3, 1.5, 0.7, 6  # batch = N: every example in the step (q = 1)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    # the released computation, by hand: per-view gradients summed, clipped at C, noised with sigma C, / B
    noise = _Fixed()
    summed = {n: torch.zeros_like(p) for n, p in start.items()}
    for image, label in zip(_fixed_views(images, views, None), labels):
        model.zero_grad()
        nn.functional.cross_entropy(model(image), label.repeat(views), reduction="sum").backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        factor = torch.clamp(clip / norm, max=1.0)
        assert norm > clip  # the clipping is active, so the identity is tested where it matters
        for n in summed:
            summed[n] += grads[n] * factor
    released = {n: start[n] - lr * (summed[n] + noise.gaussian(summed[n].shape, sigma * clip)) / batch for n in start}

    ours = DPTrainer(
        model,
        device="cpu",
        progress=False,
        augment=_fixed_views,
        aug_mult=views,
        batch_size=batch,
        max_grad_norm=clip / views,
        noise_multiplier=sigma,
        target_epsilon=None,
        lr=lr * views,
        ema_decay=None,
        steps=1,
        normalize_mean=0.0,
        normalize_std=1.0,
        insecure_seeded_noise=True,
        per_sample_method="vmap",
    )
    ours._prepare_privacy(len(images))
    ours._noise_source = _Fixed()
    ours.train_step(images, labels)
    for name, param in ours.model.named_parameters():
        assert torch.allclose(param.detach(), released[name], rtol=1e-5, atol=1e-6), name


def test_unit_norm_bias_adds_bias_over_sqrt_field_size_to_each_channel():
    model = equivariant_resnet9("D4", unit_norm_bias=True)
    convs = [m for m in model.modules() if isinstance(m, SteerableConv2d)]
    assert [c.out_size for c in convs] == [8] * 5 + [4] * 3  # D4 fields, then D2 ones after the restriction
    assert all(c.bias_scale == c.out_size**-0.5 for c in convs)
    conv = convs[0]
    with torch.no_grad():
        conv.bias.copy_(torch.arange(1.0, conv.out_fields + 1))
    assert torch.allclose(conv.expand_bias(), torch.arange(1.0, conv.out_fields + 1).repeat_interleave(8) / 8**0.5)
    assert all(c.bias_scale == 1.0 for c in equivariant_resnet9("D4").modules() if isinstance(c, SteerableConv2d))
    with pytest.raises(ValueError, match="bias_scale must be positive"):
        _conv_with_bias_scale(0.0)


def _conv_with_bias_scale(scale: float) -> SteerableConv2d:
    from equiconvert.basis import steerable_basis

    basis = steerable_basis(parse_group("D2"), "regular", "regular", 3)
    return SteerableConv2d(basis, 2, 3, padding=1, bias_scale=scale)


def test_per_sample_gradients_follow_the_bias_scale():
    """Book-keeping (the trainer's) and Opacus' grad sampler (make_private's) against autograd per example."""
    from equiconvert.privacy.bookkeeping import per_sample_gradients_bookkeeping
    from equiconvert.privacy.opacus_interop import compute_steerable_conv_grad_sample
    from equiconvert.privacy.per_sample import per_sample_gradients
    from tests.support.tiny import perturbed

    torch.manual_seed(0)
    model = perturbed(equivariant_resnet9("D4", unit_norm_bias=True, **RELEASED))
    views, labels = torch.randn(3, 2, 3, 32, 32), torch.randint(0, 10, (3,))
    params = {n: p.detach() for n, p in model.named_parameters()}
    expected, _ = per_sample_gradients(model, params, dict(model.named_buffers()), views, labels)
    grads, _ = per_sample_gradients_bookkeeping(model, views, labels)
    for key in expected:
        assert float((grads[key] - expected[key]).norm() / expected[key].norm().clamp_min(1e-12)) < 1e-5, key

    conv = _conv_with_bias_scale(0.5)
    x = torch.randn(4, conv.in_channels, 5, 5)
    backprops = torch.randn(4, conv.out_channels, 5, 5)
    sampled = compute_steerable_conv_grad_sample(conv, [x], backprops)[conv.bias]
    for i in range(4):
        conv.zero_grad()
        (conv(x[i : i + 1]) * backprops[i : i + 1]).sum().backward()
        assert torch.allclose(sampled[i], conv.bias.grad, atol=1e-5)
