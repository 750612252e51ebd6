"""Format-exact small IDX files (MNIST / Fashion-MNIST layout) for loader and command tests."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray, compress: bool = True) -> Path:
    """The real IDX layout: 0x0000, type 0x08 (ubyte), ndim, big-endian uint32 dims, then the bytes."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)
    return path


def make_idx_dir(d: Path, n_train: int = 30, n_test: int = 10, compress: bool = True, seed: int = 0) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(d / f"{prefix}-images-idx3-ubyte", images, compress)
        write_idx(d / f"{prefix}-labels-idx1-ubyte", labels, compress)
        arrays[split] = (images, labels)
    return arrays
