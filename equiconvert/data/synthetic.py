"""A deterministic random data set for smoke runs and tests (no files needed)."""

from __future__ import annotations

import numpy as np

from ..errors import ParameterError
from ._base import ImageData, check_split, make_image_data, register


@register("synthetic", "random")
def synthetic(
    data_dir: str | None = None,
    split: str = "train",
    *,
    num_examples: int | None = None,
    image_size: int = 32,
    channels: int = 3,
    num_classes: int = 10,
    seed: int = 0,
    noise: float = 48.0,
) -> ImageData:
    """Each class is a fixed random template (from ``seed``) plus Gaussian noise, so it is learnable.

    ``num_examples`` defaults to 512 (train) / 128 (test); labels cycle through the classes and
    are then shuffled. Train and test share the templates and differ in noise and order. The same
    arguments always give the same bytes. ``data_dir`` is ignored.
    """
    check_split(split)
    n = num_examples if num_examples is not None else (512 if split == "train" else 128)
    if n < 0 or image_size < 1 or channels < 1 or num_classes < 1:
        raise ParameterError("num_examples >= 0, image_size >= 1, channels >= 1 and num_classes >= 1 are required")
    templates = np.random.default_rng([seed, 0]).uniform(32, 224, size=(num_classes, channels, image_size, image_size))
    rng = np.random.default_rng([seed, 1 if split == "train" else 2])
    labels = rng.permutation(np.arange(n) % num_classes)
    images = templates[labels] + rng.normal(0.0, noise, size=(n, channels, image_size, image_size))
    images = np.clip(np.rint(images), 0, 255).astype(np.uint8)
    return make_image_data(images, labels, [f"class_{i}" for i in range(num_classes)], "synthetic", seed=seed)
