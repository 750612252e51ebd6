"""Rotated MNIST: MNIST digits, each rotated by its own uniformly random angle in [0, 360).

Sources, in ``data_dir`` (a directory or an ``.npz`` file):
- an ``.npz`` of digits with keys ``images`` (N, 28, 28) uint8 and ``labels`` (N,), such as
  ``mnist-10k.npz`` (10,000 real digits): split into train/test by a fixed-seed permutation,
  ``test_fraction=0.2`` (8,000 / 2,000 from 10,000 digits);
- an ``.npz`` with ``x_train, y_train, x_test, y_test`` (Keras's ``mnist.npz``): its own split;
- MNIST's IDX files (see :mod:`equiconvert.data.mnist`): train 60k / test 10k.

The angles come from ``numpy.random.default_rng([seed, split])``, so every call gives the same
images. The 28x28 frame is kept: rotation by angles that are not multiples of 90 degrees
interpolates (bilinear, zeros outside), and the corners of a digit's 20x20 box may be clipped
slightly; MNIST digits are centred by mass so almost nothing is lost.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ParameterError
from ._base import (
    DatasetFormatError,
    ImageData,
    candidate_dirs,
    check_split,
    make_image_data,
    not_found,
    refuse_non_finite,
    register,
    SPLITS,
)
from .mnist import IDX_FILES, MNIST_CLASSES, find_idx_file, load_idx_pair

NPZ_NAMES = ("mnist-10k.npz", "mnist.npz", "mnist_10k.npz")


def rotate_images(
    images: np.ndarray | torch.Tensor, angles_deg: np.ndarray | torch.Tensor, chunk: int = 4096
) -> torch.Tensor:
    """Rotate uint8 images (N, C, H, W) about their centre by ``angles_deg`` (N,), bilinear, zero fill.

    Positive angles turn the image anticlockwise as displayed (row 0 at the top).
    """
    x = torch.as_tensor(images)
    a = torch.as_tensor(np.asarray(angles_deg), dtype=torch.float64) * (math.pi / 180.0)
    if x.dim() != 4 or a.shape != (x.shape[0],):
        raise ParameterError(f"expected images (N, C, H, W) and angles (N,), got {tuple(x.shape)} and {tuple(a.shape)}")
    out = torch.empty_like(x, dtype=torch.uint8)
    for s in range(0, x.shape[0], chunk):
        xs, t = x[s : s + chunk].float(), a[s : s + chunk]
        cos, sin = torch.cos(t), torch.sin(t)
        # affine_grid maps output coordinates (x right, y down, in [-1, 1]) to input coordinates.
        theta = torch.stack(
            [torch.stack([cos, -sin, torch.zeros_like(t)], 1), torch.stack([sin, cos, torch.zeros_like(t)], 1)], 1
        ).float()
        grid = F.affine_grid(theta, list(xs.shape), align_corners=False)
        rot = F.grid_sample(xs, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
        out[s : s + chunk] = rot.round_().clamp_(0, 255).to(torch.uint8)
    return out


def _npz_digits(path: Path, split: str, test_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        keys = set(z.files)
        if {"x_train", "y_train", "x_test", "y_test"} <= keys:
            refuse_non_finite(z[f"x_{split}"], f"{path} (x_{split})")
            return z[f"x_{split}"], z[f"y_{split}"]
        img_key = next((k for k in ("images", "x", "data") if k in keys), None)
        lbl_key = next((k for k in ("labels", "y", "targets") if k in keys), None)
        if img_key is None or lbl_key is None:
            raise DatasetFormatError(
                f"{path}: expected keys 'images' and 'labels' (or x_train, y_train, x_test, "
                f"y_test), found {sorted(keys)}"
            )
        images, labels = z[img_key], z[lbl_key]
    refuse_non_finite(images, f"{path} ({img_key})")
    if not 0.0 < test_fraction < 1.0:
        raise ParameterError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    perm = np.random.default_rng(split_seed).permutation(len(labels))
    n_test = int(round(len(labels) * test_fraction))
    idx = perm[n_test:] if split == "train" else perm[:n_test]
    return images[np.sort(idx)], labels[np.sort(idx)]


def _find_source(data_dir: str | None) -> tuple[str, Path] | None:
    for d in candidate_dirs(data_dir):
        if d.is_file() and d.suffix == ".npz":
            return "npz", d
        for sub in (d, d / "MNIST" / "raw", d / "mnist"):
            if all(find_idx_file(sub, s) for sp in SPLITS for s in IDX_FILES[sp]):
                return "idx", sub
        for n in NPZ_NAMES:
            if (d / n).is_file():
                return "npz", d / n
    return None


@register("rotated_mnist", "rotmnist", "mnist_rot", "mnistrot")
def rotated_mnist(
    data_dir: str | None,
    split: str = "train",
    *,
    seed: int = 0,
    test_fraction: float = 0.2,
    split_seed: int = 0,
    max_angle: float = 360.0,
) -> ImageData:
    """Rotated MNIST (1x28x28 uint8); ``meta['angles']`` holds each image's angle in degrees.

    Angles are uniform in [0, max_angle); ``max_angle=0`` gives the same split unrotated (a baseline).
    """
    check_split(split)
    found = _find_source(data_dir)
    if found is None:
        raise not_found(
            "rotated_mnist",
            candidate_dirs(data_dir),
            f"an .npz of digits ({' or '.join(NPZ_NAMES)}, keys 'images' (N, 28, 28) uint8 and 'labels'), "
            f"or MNIST's IDX files ({', '.join(s + '.gz' for sp in SPLITS for s in IDX_FILES[sp])}); "
            f"data_dir may also name the .npz file itself",
        )
    kind, path = found
    if kind == "idx":
        base = load_idx_pair(path, split, MNIST_CLASSES, "mnist")
        images, labels = base.images.numpy()[:, 0], base.labels.numpy()
    else:
        images, labels = _npz_digits(path, split, test_fraction, split_seed)
    images = np.asarray(images)
    if images.ndim == 2 and images.shape[1] == 784:
        images = images.reshape(-1, 28, 28)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DatasetFormatError(f"{path}: expected uint8 digits (N, 28, 28), got {images.dtype} {images.shape}")
    angles = np.random.default_rng([seed, SPLITS.index(split)]).uniform(0.0, 360.0, size=len(images))
    angles *= max_angle / 360.0
    rotated = rotate_images(images[:, None], angles).numpy() if max_angle else images[:, None]
    return make_image_data(
        rotated,
        np.asarray(labels, dtype=np.int64),
        MNIST_CLASSES,
        "rotated_mnist",
        source=str(path),
        angles=angles,
        seed=seed,
    )
