"""Teach a canonicaliser the upright pose on public images, before any private step.

Private fine-tuning with pose_prior_loss starts better when the canonicaliser already puts upright images in the
identity pose. This trains the canonicaliser alone on images that must be public: it spends no privacy budget, so
it must never see the private training set.
"""

from __future__ import annotations

import torch

from .canonicalize import CanonicalizationError, CanonicalizedModel, identity_pose_loss, pose_scores


def teach_upright_pose(
    model: CanonicalizedModel,
    public_images: torch.Tensor,
    steps: int,
    *,
    seed: int = 0,
    batch_size: int = 128,
    lr: float = 2e-3,
    device: str | torch.device = "cpu",
) -> None:
    """Train `model`'s canonicaliser (Adam on random batches) to score the identity pose highest on upright images.

    Args:
        model: the canonicalised model; only its canonicaliser changes, and it is left on the CPU.
        public_images: upright, normalised public images (N, C, H, W) as the model sees them.
        steps: Adam steps; 0 leaves the canonicaliser as it is.
        seed: seeds the batches and torch's generator.
        batch_size: images per step.
        lr: Adam's learning rate.
        device: where the steps run.

    Raises:
        CanonicalizationError: a model that is not a CanonicalizedModel, a negative step count, no images.
    """
    if not isinstance(model, CanonicalizedModel):
        raise CanonicalizationError(
            f"teach_upright_pose: model must be a CanonicalizedModel, got {type(model).__name__}"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise CanonicalizationError(f"teach_upright_pose: steps must be an int >= 0, got {steps!r}")
    if steps and len(public_images) == 0:
        raise CanonicalizationError("teach_upright_pose: public_images is empty")
    torch.manual_seed(seed)
    canonicalizer = model.canonicalizer.to(device).train()
    optimizer = torch.optim.Adam(canonicalizer.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(0, len(public_images), (batch_size,), generator=generator)
        scores = pose_scores(canonicalizer, public_images[batch].to(device), model.group.order)
        optimizer.zero_grad()
        identity_pose_loss(scores, model.temperature).mean().backward()
        optimizer.step()
    canonicalizer.cpu()
