"""One DP step with the noise off: our trainer against naive per-example loops of our formula and of the released
code's, and (with the checkout) the released step on its model against ours on the mapped model."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # the package and the sibling modules, also when loaded by path
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from fidelity_model import (  # noqa: E402
    RELEASED_CONVS,
    map_released,
    our_convs,
    our_released_settings_model,
    refreshed,
    relative_difference,
)
from released_code import released_config  # noqa: E402

from equiconvert.models import equivariant_resnet9  # noqa: E402
from equiconvert.nn import SteerableConv2d  # noqa: E402


class _ZeroNoise:
    def gaussian(self, shape, std, dtype=torch.float32):
        return torch.zeros(tuple(shape), dtype=dtype)


def fixed_views(images: torch.Tensor, views: int, generator=None) -> torch.Tensor:
    """K deterministic views (the image, then shifted and flipped copies), the same for both computations."""
    out = [images]
    for k in range(1, views):
        shifted = images.roll(k, dims=-1)
        out.append(shifted.flip(-1) if k % 2 else shifted)
    return torch.stack(out, dim=1)


def naive_step(
    model: nn.Module, images, labels, views: int, clip: float, lr: float, divisor: float, reduce_views: str
) -> dict[str, Any]:
    """A per-example loop: each example's view gradients reduced ('mean' ours, 'sum' released), clipped with
    Opacus' rule C / (norm + 1e-6), summed, divided by `divisor`, one SGD step; the EMA's first update
    (warm-up decay 2/11 in both codes)."""
    params = dict(model.named_parameters())
    start = {n: p.detach().clone() for n, p in params.items()}
    clipped_sum = {n: torch.zeros_like(p) for n, p in start.items()}
    norms, clipped_grads = [], []
    for image_views, label in zip(fixed_views(images, views), labels):
        per_view = []
        for view in image_views:
            model.zero_grad()
            F.cross_entropy(model(view[None]), label[None]).backward()
            per_view.append({n: p.grad.detach().clone() for n, p in params.items()})
        grad = {n: sum(g[n] for g in per_view) for n in start}
        if reduce_views == "mean":
            grad = {n: g / views for n, g in grad.items()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grad.values()))
        factor = torch.clamp(clip / (norm + 1e-6), max=1.0)
        clipped = {n: g * factor for n, g in grad.items()}
        clipped_grads.append(clipped)
        norms.append(float(norm))
        for n in clipped_sum:
            clipped_sum[n] += clipped[n]
    after = {n: start[n] - lr * clipped_sum[n] / divisor for n in start}
    decay = min(0.999, (1 + 1) / (10 + 1))
    ema = {n: decay * start[n] + (1 - decay) * after[n] for n in start}
    return {"start": start, "norms": norms, "clipped": clipped_grads, "sum": clipped_sum, "after": after, "ema": ema}


def trainer_step(model: nn.Module, images, labels, views: int, clip: float, lr: float, ema_decay: float):
    """Our DPTrainer's step with the noise source zeroed, on the whole batch (q = 1, no Poisson draw left out)."""
    from equiconvert.training.trainer import DPTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPTrainer(
            model,
            device="cpu",
            progress=False,
            augment=fixed_views,
            aug_mult=views,
            batch_size=len(images),
            max_grad_norm=clip,
            noise_multiplier=1.0,
            target_epsilon=None,
            lr=lr,
            ema_decay=ema_decay,
            steps=1,
            normalize_mean=0.0,
            normalize_std=1.0,
            insecure_seeded_noise=True,
            per_sample_method="vmap",
        )
        trainer._prepare_privacy(len(images))
    trainer._noise_source = _ZeroNoise()
    params = {n: p.detach() for n, p in trainer.model.named_parameters()}
    buffers = dict(trainer.model.named_buffers())
    grads, _ = trainer._per_sample_gradients(params, buffers, fixed_views(images, views), labels)
    trainer.train_step(images, labels)
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return grads, after, {n: t.clone() for n, t in trainer.ema.params.items()}


def restore(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(values[name])


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(relative_difference(a[n], b[n]) for n in b)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return equivariant_resnet9(
        "C4", layout=(8, 8, 8), norm_groups=4, weight_standardization="layer", unit_norm_bias=True
    )


def dp_step_ours(batch: int = 3, views: int = 2, clip: float = 0.05, lr: float = 0.5) -> dict[str, Any]:
    """Our trainer's step (noise off) against naive per-example loops on a small converted model: of our formula
    (mean over views, clip C), and of the released one (sum over views, clip K C, lr / K: the released recipe's
    identity). Needs only our code."""
    images = torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(batch) % 10
    model = tiny_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    naive = naive_step(model, images, labels, views, clip, lr, batch, "mean")
    restore(model, start)
    released = naive_step(model, images, labels, views, clip * views, lr / views, batch, "sum")
    restore(model, start)
    grads, after, ema = trainer_step(model, images, labels, views, clip, lr, 0.999)
    per_example = max(
        relative_difference(grads[n][i], naive["clipped"][i][n] / min(1.0, clip / (naive["norms"][i] + 1e-6)))
        for i in range(batch)
        for n in start
    )
    update = {n: after[n] - start[n] for n in start}
    return {
        "model": "C4 Equivariant-ResNet9, layout (8, 8, 8), 16x16 inputs",
        "batch": batch,
        "views": views,
        "clip": clip,
        "lr": lr,
        "per_example_norms": naive["norms"],
        "clipped": sum(n > clip for n in naive["norms"]),
        "per_example_gradients_relative_difference": per_example,
        "clipped_sum_relative_difference": max_relative_difference(
            {n: -u * batch / lr for n, u in update.items()}, naive["sum"]
        ),
        "update_relative_difference": max_relative_difference(update, {n: naive["after"][n] - start[n] for n in start}),
        "ema_relative_difference": max_relative_difference(
            {n: ema[n] - start[n] for n in start}, {n: naive["ema"][n] - start[n] for n in start}
        ),
        "released_formula_update_relative_difference": max_relative_difference(
            update, {n: released["after"][n] - start[n] for n in start}
        ),
    }


def dp_step_released(root: Path, released: nn.Module, ours: nn.Module, batch: int = 3, views: int = 2) -> dict:
    """The released step (its formula run on its model: view gradients summed, clipped at C, divided by the batch,
    SGD at its lr) against our trainer's step with the released recipe's translation (clip C/K, lr x K) on the
    mapped model, noise off. Both start from the same function; the updates meet as dense filters in our channel
    order, and as logits after the step."""
    config = released_config(root)
    clip, lr = float(config["dp"]["clip_norm"]), float(config["optim"]["optimizer"]["lr"])
    images = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    labels = torch.arange(batch) % 10
    probe = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    before_rel = map_released(released, ours).targets
    released.train()
    naive = naive_step(released, images, labels, views, clip, lr, batch, "sum")
    restore(released, naive["after"])
    after_rel = map_released(released, ours).targets
    refreshed(released)
    with torch.no_grad():
        rel_logits = released(probe)
    restore(released, naive["start"])
    refreshed(released)
    convs = dict((n, m) for n, m in ours.named_modules() if isinstance(m, SteerableConv2d))
    with torch.no_grad():
        before_ours = [c.expand_filter() for c in convs.values()]
    start = {n: p.detach().clone() for n, p in ours.named_parameters()}
    grads, after, _ = trainer_step(ours, images, labels, views, clip / views, lr * views, 0.999)
    our_norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values())) * views
    restore(ours, after)
    with torch.no_grad():
        our_moved = [c.expand_filter() - b for c, b in zip(convs.values(), before_ours)]
        our_logits = ours.eval()(probe)
    restore(ours, start)
    own_init = _relative_steps_from_our_init(images, labels, views, clip, lr)
    rows = []
    for name, rel_b, rel_a, mine, own in zip(RELEASED_CONVS, before_rel, after_rel, our_moved, own_init):
        moved = rel_a - rel_b
        cosine = float((moved * mine).sum() / (moved.norm() * mine.norm()).clamp_min(1e-30))
        rows.append(
            {
                "layer": name,
                "released_filter_change": float(moved.norm()),
                "our_filter_change": float(mine.norm()),
                "relative_difference": relative_difference(mine, moved),
                "cosine": cosine,
                "released_relative_step": float(moved.norm() / rel_b.norm()),
                "our_released_recipe_relative_step": own,
            }
        )
    return {
        "batch": batch,
        "views": views,
        "clip": clip,
        "lr": lr,
        "released_per_example_norms": naive["norms"],
        "our_per_example_norms_times_views": our_norms.tolist(),
        "logits_after_step_relative_difference": relative_difference(our_logits, rel_logits),
        "note": "norms of the dense filters' update per layer (relative steps: over the filter's norm, ours from our "
        "own initialisation with the released recipe's model); the released code clips and steps in escnn's "
        "coefficients (and standardizes them), the mapped model of ours in our orthonormal basis' coefficients "
        "without standardization (the only way its function equals the released one), so one step from the same "
        "function moves it differently",
        "layers": rows,
    }


def _relative_steps_from_our_init(images, labels, views: int, clip: float, lr: float) -> list[float]:
    """|filter change| / |filter| per conv in one step of the released recipe's model (weight standardization on)
    from our own initialisation: the step size the released code's is compared with."""
    torch.manual_seed(0)
    model = our_released_settings_model(standardize=True)
    convs = our_convs(model)
    with torch.no_grad():
        before = [c.expand_filter() for c in convs]
    _, after, _ = trainer_step(model, images, labels, views, clip / views, lr * views, 0.999)
    restore(model, after)
    with torch.no_grad():
        return [float((c.expand_filter() - b).norm() / b.norm()) for c, b in zip(convs, before)]
