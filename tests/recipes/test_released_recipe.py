"""The shipped recipe with the released code's settings (hlzl/equivariant): it loads, resolves to the model and
trainer options it says, and its numbers follow from the released code's as its comments state."""

from __future__ import annotations

import pytest
import torch

from equiconvert.nn import FieldGroupNorm, SteerableConv2d
from equiconvert.privacy.accounting import PrivacyLedger
from equiconvert.recipes.recipe import apply_overrides, load_recipe
from equiconvert.recipes.build_model import build_model
from equiconvert.recipes.run_spec import spec_of, trainer_options

NAME = "cifar10_paper_d4_eps8_released"
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)
N, K, RELEASED_BATCH, RELEASED_CLIP, RELEASED_LR = 50_000, 4, 8192, 2.0, 2.0


def test_the_released_recipe_resolves_to_the_released_codes_settings():
    recipe = load_recipe(NAME)
    spec = spec_of(recipe)
    assert (spec.model, spec.group, spec.dataset) == ("equiconvert:equivariant_resnet9", "D4", "cifar10")
    assert spec.model_kwargs == {
        "weight_standardization": "layer",
        "norm_group_rule": "released",
        "unit_norm_bias": True,
    }
    t = trainer_options(recipe)
    assert (t["aug_mult"], t["momentum"], t["delta"]) == (K, 0.0, 1e-5)
    assert t["batch_size"] == N // 6 and t["steps"] == 353 * 6  # Opacus' rate 1/len(loader), whole epochs
    assert t["max_grad_norm"] == RELEASED_CLIP / K  # sum of K views clipped at C == K x (mean clipped at C/K)
    assert t["lr"] == RELEASED_LR * K * t["batch_size"] / RELEASED_BATCH  # it divides by 8192, we by the expected
    assert tuple(t["normalize_mean"]) == CIFAR10_MEAN and tuple(t["normalize_std"]) == CIFAR10_STD


def test_the_released_recipes_model_has_the_released_options():
    spec = spec_of(load_recipe(NAME))
    model, plain_count = build_model(spec, 10, 3)
    norms = [m.num_groups for m in model.modules() if isinstance(m, FieldGroupNorm)]
    assert norms == [1, 1, 1, 1, 1, 3, 3, 3, 3, 3]  # stem, layer1, res1 x2 + scale, layer2, layer3, res2 x2 + scale
    convs = [m for m in model.modules() if isinstance(m, SteerableConv2d)]
    assert {c.weight_standardization for c in convs} == {"layer"}
    assert all(c.bias_scale == c.out_size**-0.5 for c in convs)
    assert sum(p.numel() for p in model.parameters()) == 255_675
    with pytest.raises(ValueError, match="conversion options; the unconverted baseline"):
        from equiconvert.recipes.build_model import refuse_conversion_options_for_baseline

        refuse_conversion_options_for_baseline(spec_of(apply_overrides(load_recipe(NAME), ["conversion.group=none"])))


def test_the_normalisation_constants_reach_the_trainer():
    from equiconvert.training.trainer import DPTrainer

    options = trainer_options(load_recipe(NAME))
    trainer = DPTrainer(torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3), torch.nn.Flatten()), device="cpu", **options)
    mean, std = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)
    images = mean + std * torch.tensor([0.0, 1.0, -2.0]).view(1, 3, 1, 1).expand(1, 3, 4, 4)
    normalized = trainer._normalize(images)
    assert torch.allclose(normalized[0, :, 0, 0], torch.tensor([0.0, 1.0, -2.0]), atol=1e-5)


def test_the_noise_multiplier_is_opacus_for_the_released_arguments_and_its_epsilon_is_the_recipes():
    from opacus.accountants.utils import get_noise_multiplier

    t = trainer_options(load_recipe(NAME))
    epochs = int(2160 / (N / RELEASED_BATCH))  # the released config's update_steps 2160 in whole epochs: 353
    sigma = get_noise_multiplier(
        target_epsilon=8, target_delta=1e-5, sample_rate=RELEASED_BATCH / N, epochs=epochs, accountant="rdp"
    )
    assert (epochs, sigma) == (353, t["noise_multiplier"])
    spent = PrivacyLedger("rdp", 1e-5, None, t["batch_size"] / N, sigma).epsilon_after(t["steps"])
    assert 8.0 < spent <= t["target_epsilon"] < spent + 0.01  # 8.078: the budget the run really spends


def _released_ema(trajectory: torch.Tensor, physical_batches: torch.Tensor) -> torch.Tensor:
    """The released code's EMA (torch_ema, decay 0.999, warm-up (1 + k)/(10 + k) over updates k = 1, 2, ...),
    updated after every physical batch: the weights change at the last physical batch of each step only."""
    shadow, k = trajectory[0].clone(), 0
    for t, n in enumerate(physical_batches.tolist(), start=1):
        for j in range(n):
            k += 1
            decay = min(0.999, (1 + k) / (10 + k))
            shadow += (1 - decay) * ((trajectory[t] if j == n - 1 else trajectory[t - 1]) - shadow)
    return shadow


def test_one_ema_update_per_step_at_the_recipes_decay_comes_close_to_the_released_per_batch_ema():
    from equiconvert.training.ema import ExponentialMovingAverage

    t = trainer_options(load_recipe(NAME))
    assert t["ema_decay"] == pytest.approx(0.999**17, abs=1e-4)
    generator = torch.Generator().manual_seed(0)
    steps = t["steps"]
    trajectory = torch.randn(steps + 1, 64, generator=generator, dtype=torch.float64).cumsum(0)
    batches = 16 + (torch.rand(steps, generator=generator) < 0.955).long()  # ceil(B/512): B = 8192 or less ~4.5%
    released = _released_ema(trajectory, batches)

    def ours(decay: float) -> torch.Tensor:
        ema = ExponentialMovingAverage({"w": trajectory[0].clone()}, decay)
        for step in range(1, steps + 1):
            ema.update({"w": trajectory[step]}, step)
        return ema.params["w"]

    scale = (trajectory[-1] - released).norm()
    assert float((ours(t["ema_decay"]) - released).norm() / scale) < 0.05
    assert float((ours(0.999) - released).norm() / scale) > 0.5  # the default per-step EMA is far from it
