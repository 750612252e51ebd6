"""CIFAR-10: torchvision's pickle layout (``cifar-10-batches-py/``) or an ImageFolder copy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ._base import DatasetFormatError, ImageData, candidate_dirs, check_split, make_image_data, not_found, register
from .array_pickle import load_array_pickle
from .imagefolder import find_split_dir, load_image_folder

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
PICKLE_DIR = "cifar-10-batches-py"
PICKLE_FILES = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
FOLDER_NAMES = ("cifar10", "cifar-10", "CIFAR10", "CIFAR-10")
EXPECTED = (
    f"{PICKLE_DIR}/data_batch_1..5 and {PICKLE_DIR}/test_batch (the 'python version' of CIFAR-10, "
    f"as torchvision's CIFAR10(root) keeps it), or an ImageFolder copy train/<class>/*.png|jpg and "
    f"test/<class>/*.png|jpg (also under a cifar10/ sub-folder), 32x32 images"
)


def _pickle_dir(d: Path) -> Path | None:
    for p in (d / PICKLE_DIR, d):
        if (p / "data_batch_1").is_file() or (p / "test_batch").is_file():
            return p
    return None


def _folder_root(d: Path) -> Path | None:
    for p in (d, *(d / n for n in FOLDER_NAMES)):
        if p.is_dir() and (find_split_dir(p, "train") or find_split_dir(p, "test")):
            return p
    return None


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    d = load_array_pickle(path)  # a pickle, read without running code (array_pickle.py)
    try:
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d.get(b"labels", d.get(b"fine_labels")), dtype=np.int64)
    except (KeyError, TypeError) as exc:
        raise DatasetFormatError(f"{path}: not a CIFAR-10 batch (needs keys b'data' and b'labels')") from exc
    if data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (data.shape[0],):
        raise DatasetFormatError(
            f"{path}: expected data (N, 3072) and labels (N,), got {data.shape} and {labels.shape}"
        )
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10_pickle(batch_dir: Path, split: str) -> ImageData:
    missing = [n for n in PICKLE_FILES[split] if not (batch_dir / n).is_file()]
    if missing:
        raise not_found("cifar10", [batch_dir], EXPECTED, f"Missing there: {', '.join(missing)}")
    parts = [_read_batch(batch_dir / n) for n in PICKLE_FILES[split]]
    classes = CIFAR10_CLASSES
    meta = batch_dir / "batches.meta"
    if meta.is_file():
        record = load_array_pickle(meta)
        if not isinstance(record, dict):
            raise DatasetFormatError(f"{meta}: not CIFAR-10's batches.meta (a dict with b'label_names')")
        names = record.get(b"label_names")
        if names:
            classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    return make_image_data(
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        classes,
        "cifar10",
        source=str(batch_dir),
        format="pickle",
    )


@register("cifar10", "cifar-10")
def cifar10(data_dir: str | None, split: str = "train", **kwargs) -> ImageData:
    """CIFAR-10 from ``data_dir``: the pickle batches if present, else an ImageFolder copy.

    ImageFolder keyword options (``cache``, ``num_workers``, ``image_size``) are passed on; the
    class folders sort into CIFAR-10's label order (airplane=0 ... truck=9).
    """
    check_split(split)
    searched = candidate_dirs(data_dir)
    for d in searched:
        p = _pickle_dir(d)
        if p is not None:
            return load_cifar10_pickle(p, split)
        root = _folder_root(d)
        if root is not None:
            data = load_image_folder(root, split, name="cifar10", **kwargs)
            if data.image_shape[1:] != (32, 32) and kwargs.get("image_size") is None:
                raise DatasetFormatError(f"{root}: CIFAR-10 images are 32x32, these are {data.image_shape[1:]}")
            data.meta["format"] = "imagefolder"
            return data
    raise not_found("cifar10", searched, EXPECTED)
