"""canonicalize for groups with turns off the pixel grid (C8, D8): exact on the grid elements, approximate on
the others (undone by interpolation), with the error measured by check_equivariance."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equiconvert
from equiconvert.adapt import CanonicalizationError, canonicalize
from equiconvert.adapt.canonicalize import group_poses, turn
from equiconvert.errors import ParameterError
from equiconvert.groups import parse_group

SIZE = 24


def _smooth_disc_images(count: int = 8, seed: int = 0) -> torch.Tensor:
    """Smooth random images (bicubic upsampling of 6 x 6 noise), masked to their inscribed disc."""
    generator = torch.Generator().manual_seed(seed)
    low = torch.randn(count, 3, SIZE // 4, SIZE // 4, generator=generator)
    images = F.interpolate(low, size=(SIZE, SIZE), mode="bicubic", align_corners=False)
    coords = torch.arange(SIZE) - (SIZE - 1) / 2
    return images * ((coords[:, None] ** 2 + coords[None, :] ** 2).sqrt() <= (SIZE - 1) / 2)


def _backbone() -> nn.Module:
    """A "pretrained" CNN that depends on the pose: its head reads every position (no global pooling)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, stride=2)
    return nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(4 * 11 * 11, 5)).eval()


def test_turn_agrees_with_rot90_and_poses_undo_their_action():
    x = torch.randn(2, 3, 9, 9)
    torch.testing.assert_close(turn(x, math.pi / 2), torch.rot90(x, 1, (-2, -1)), rtol=0, atol=1e-5)
    assert turn(x, 0.0) is x
    poses = group_poses(parse_group("D8"))
    assert [p.name for p in poses[:3]] == ["rot0", "rot45", "rot90"] and poses[8].name == "rot0+flip"
    grid = {g.name: g for g in parse_group("D8").grid_elements}
    for pose in poses:
        if pose.name in grid:  # quarter turns and flips: rot90/flip only, bit for bit
            assert pose.residual == 0.0 and torch.equal(pose.act(x), grid[pose.name].act_on_grid(x))
            assert torch.equal(pose.undo(pose.act(x)), x)
        else:
            assert abs(pose.residual) == pytest.approx(math.pi / 4)


def test_c4_and_d4_stay_exactly_invariant_with_no_off_grid_angles():
    for group in ("C4", "D4"):
        torch.manual_seed(0)
        wrapped = canonicalize(_backbone(), group, fields=1).eval()
        assert wrapped.off_grid_angles == () and wrapped.reach is None
        result = equiconvert.check_equivariance(wrapped, images=_smooth_disc_images())
        assert result.angle_errors == {} and result.max_error <= 1e-5, (group, result)


def _per_image_errors(model: nn.Module, images: torch.Tensor) -> list[float]:
    """Each image's largest relative output error under C8's off-grid turns (as check_equivariance's angles)."""
    from torchvision.transforms.functional import InterpolationMode, rotate

    with torch.no_grad():
        reference = model(images)
        turned = [model(rotate(images, angle, InterpolationMode.BILINEAR)) for angle in (45.0, 135.0, 225.0, 315.0)]
    errors = torch.stack([(out - reference).abs().amax(dim=1) for out in turned]).amax(dim=0)
    return (errors / reference.abs().amax(dim=1)).tolist()


@pytest.mark.parametrize("group", ["C8", "D8"])
def test_off_grid_turns_are_approximately_invariant_and_much_better_than_the_backbone(group):
    backbone = _backbone()
    torch.manual_seed(0)
    wrapped = canonicalize(backbone, group, fields=1).eval()
    images = _smooth_disc_images()
    result = equiconvert.check_equivariance(wrapped, images=images)
    assert set(result.angle_errors) == {45.0, 135.0, 225.0, 315.0}
    assert all(math.isfinite(error) for error in result.angle_errors.values())
    assert result.max_error <= 1e-5  # the quarter turns (and flips) stay exact
    # per image: most keep their pose (interpolation error only); a near-tie of two scores may flip one
    wrapped_errors, plain_errors = _per_image_errors(wrapped, images), _per_image_errors(backbone, images)
    assert statistics.median(plain_errors) > 1.0
    assert statistics.median(wrapped_errors) < statistics.median(plain_errors) / 5, (wrapped_errors, plain_errors)
    assert sum(error < 0.3 for error in wrapped_errors) >= 6, wrapped_errors


def test_images_too_small_for_the_scored_disc_are_refused():
    wrapped = canonicalize(nn.Identity(), "C8", kernel_size=3, pool=2)
    with pytest.raises(CanonicalizationError, match="too small for C8"):
        wrapped(torch.randn(1, 3, 8, 8))


def test_check_equivariance_refuses_images_of_the_wrong_shape():
    wrapped = canonicalize(nn.Identity(), "C4")
    with pytest.raises(ParameterError, match="images must be a \\(B, C, S, S\\)"):
        equiconvert.check_equivariance(wrapped, images=torch.randn(2, 3, 8, 9))
    with pytest.raises(ParameterError, match="input_size=16 contradicts"):
        equiconvert.check_equivariance(wrapped, images=torch.randn(2, 3, 8, 8), input_size=16)


def test_export_keeps_the_off_grid_choice():
    wrapped = canonicalize(_backbone(), "C8", fields=1).eval()
    exported = equiconvert.export(wrapped)
    x = _smooth_disc_images(2)
    with torch.no_grad():
        torch.testing.assert_close(exported(x), wrapped(x), rtol=0, atol=0)
