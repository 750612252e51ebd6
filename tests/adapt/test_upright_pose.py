"""teach_upright_pose: the canonicaliser learns, from public images alone, to keep upright images in the identity pose."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from equiconvert import canonicalize, teach_upright_pose
from equiconvert.adapt import CanonicalizationError
from equiconvert.adapt.canonicalize import identity_pose_loss, pose_scores
from equiconvert.data import load_dataset
from equiconvert.models import SmallCNN

FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not FASHION.is_dir(), reason=f"needs Fashion-MNIST in {FASHION}")
def test_teaching_the_upright_pose_moves_held_out_images_toward_the_identity_pose():
    data = load_dataset("fashion_mnist", str(FASHION), split="train")
    images = (data.images[data.labels < 5].float() / 255 - 0.5) / 0.5  # tops, trousers, pullovers, dresses, coats
    taught, held_out = images[:2048], images[-256:]
    torch.manual_seed(0)
    model = canonicalize(SmallCNN(), "C4", in_channels=1, fields=2, kernel_size=5, pool=2)
    backbone = {name: value.clone() for name, value in model.backbone.state_dict().items()}

    def prior_loss() -> float:  # cross-entropy of the pose scores against the identity pose
        with torch.no_grad():
            scores = pose_scores(model.canonicalizer, held_out, model.group.order)
        return float(identity_pose_loss(scores, model.temperature).mean())

    before = prior_loss()
    teach_upright_pose(model, taught, steps=40, seed=0)
    after = prior_loss()
    assert after < before - 0.05, (before, after)  # from ln(4) = 1.386, the loss of four equal scores
    # quarter turns are the easy part: nearly every upright image is then read as rot0 or rot180
    assert sum(pose in ("rot0", "rot180") for pose in model.poses(held_out)) > 0.9 * len(held_out)
    # only the canonicaliser learns: the backbone is bit-identical
    assert all(torch.equal(model.backbone.state_dict()[name], value) for name, value in backbone.items())


def test_zero_steps_leave_the_canonicaliser_as_it_is_and_bad_arguments_are_refused():
    model = canonicalize(SmallCNN(), "C4", in_channels=1)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    teach_upright_pose(model, torch.zeros(0, 1, 28, 28), steps=0)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())
    with pytest.raises(CanonicalizationError, match="steps must be an int >= 0"):
        teach_upright_pose(model, torch.zeros(4, 1, 28, 28), steps=-1)
    with pytest.raises(CanonicalizationError, match="public_images is empty"):
        teach_upright_pose(model, torch.zeros(0, 1, 28, 28), steps=1)
    with pytest.raises(CanonicalizationError, match="must be a CanonicalizedModel"):
        teach_upright_pose(SmallCNN(), torch.zeros(4, 1, 28, 28), steps=1)
