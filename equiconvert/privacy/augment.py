"""Augmentation multiplicity (De et al. 2022; Hölzl et al.), batched on the data's device.

With DP-SGD each example's gradient is averaged over K augmented views *before*
clipping, so augmentation reduces gradient variance without costing privacy.
View 0 is the unaugmented image (the papers count it among the K); the others
are reflect-pad + random crop + random horizontal flip. Everything is one
gather per batch: K views of a whole batch cost one indexing kernel, not a
Python loop over samples.
"""
from __future__ import annotations

import torch


def _reflect(index: torch.Tensor, size: int) -> torch.Tensor:
    """Map positions in [-(size-1), 2(size-1)] onto [0, size) as reflection padding does (edge not repeated)."""
    index = index.abs()
    return torch.where(index > size - 1, 2 * (size - 1) - index, index)


def augmentation_params(
    batch_size: int,
    num_augmented: int,
    padding: int,
    flip: bool,
    generator: torch.Generator | None,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (offset_y, offset_x, flipped) of shape (batch_size, num_augmented) each.

    Offsets are crop corners in the padded image, uniform in [0, 2*padding];
    `flipped` is Bernoulli(0.5) (all False when `flip` is off). Separate from
    `apply_augmentation` so a test (or a replay) can reproduce a draw exactly.
    """
    shape = (batch_size, num_augmented)
    offset_y = torch.randint(0, 2 * padding + 1, shape, generator=generator, device=device)
    offset_x = torch.randint(0, 2 * padding + 1, shape, generator=generator, device=device)
    if flip:
        flipped = torch.rand(shape, generator=generator, device=device) < 0.5
    else:
        flipped = torch.zeros(shape, dtype=torch.bool, device=device)
    return offset_y, offset_x, flipped


def apply_augmentation(
    images: torch.Tensor,
    offset_y: torch.Tensor,
    offset_x: torch.Tensor,
    flipped: torch.Tensor,
    padding: int,
) -> torch.Tensor:
    """(B, C, H, W) -> (B, A, C, H, W): crops of the reflect-padded images at the given corners, then flips.

    Pixel (i, j) of a crop at (dy, dx) is padded[i + dy, j + dx] =
    image[reflect(i + dy - p), reflect(j + dx - p)]; a horizontal flip reads
    column W-1-j instead. Indexing the unpadded image directly avoids a padded
    copy and works for every dtype (uint8 included) on every device.
    """
    batch, _, height, width = images.shape
    device = images.device
    rows = torch.arange(height, device=device)
    cols = torch.arange(width, device=device)
    row_index = _reflect(rows + offset_y[..., None] - padding, height)  # (B, A, H)
    col_source = torch.where(flipped[..., None], width - 1 - cols, cols)  # (B, A, W)
    col_index = _reflect(col_source + offset_x[..., None] - padding, width)  # (B, A, W)
    sample = torch.arange(batch, device=device)[:, None, None, None]
    channels_last = images.permute(0, 2, 3, 1)  # (B, H, W, C): advanced indices adjacent -> (B, A, H, W, C)
    views = channels_last[sample, row_index[..., :, None], col_index[..., None, :]]
    return views.permute(0, 1, 4, 2, 3)


def augment_views(
    images: torch.Tensor,
    num_views: int,
    generator: torch.Generator | None,
    padding: int = 4,
    flip: bool = True,
) -> torch.Tensor:
    """(B, C, H, W) -> (B, K, C, H, W); view 0 is the input, views 1..K-1 are random crops/flips.

    `generator` must live on `images.device` (None uses the global RNG of that
    device). Offsets and flips are independent per sample and per view.
    """
    if images.dim() != 4:
        raise ValueError(f"images must be (B, C, H, W), got shape {tuple(images.shape)}")
    if num_views < 1:
        raise ValueError(f"num_views must be >= 1, got {num_views}")
    height, width = images.shape[-2:]
    if padding < 0 or padding >= min(height, width):
        raise ValueError(f"reflection padding must be in [0, min(H, W) - 1] = [0, {min(height, width) - 1}], got {padding}")
    if generator is not None and generator.device.type != images.device.type:
        raise ValueError(f"generator is on {generator.device}, images on {images.device}; they must match")
    original = images.unsqueeze(1)
    if num_views == 1:
        return original
    params = augmentation_params(images.shape[0], num_views - 1, padding, flip, generator, images.device)
    return torch.cat([original, apply_augmentation(images, *params, padding=padding)], dim=1)
