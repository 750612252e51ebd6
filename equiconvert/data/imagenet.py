"""Downsampled ImageNet (Chrabaszcz et al. 2017: Imagenet16/32/64) in its npz batch format.

Train files ``train_data_batch_1.npz`` ... ``train_data_batch_10.npz``, validation file
``val_data.npz`` (or ``Imagenet32_val.npz`` / ``Imagenet64_val.npz``), each with ``data``
(N, 3*R*R) uint8, rows laid out as the R, G and B planes, and ``labels`` (N,) starting at 1.
They may lie in ``data_dir`` or one or two folders below it (the archives unpack to
``Imagenet32_train_npz/`` and ``Imagenet32_val_npz/``). Labels are returned 0-based; class names
come from ``map_clsloc.txt`` when it is there, else "0".."999". The test split is the
validation set (ImageNet's test labels are not public).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ._base import (
    DatasetFormatError,
    ImageData,
    candidate_dirs,
    check_split,
    make_image_data,
    not_found,
    refuse_non_finite,
    register,
)

_TRAIN_RE = re.compile(r"^train_data_batch_(\d+)\.npz$")
VAL_NAMES = ("val_data.npz", "Imagenet{r}_val.npz")


def _walk(d: Path, depth: int = 2) -> list[Path]:
    dirs, frontier = [d], [d]
    for _ in range(depth):
        frontier = [s for f in frontier if f.is_dir() for s in sorted(f.iterdir()) if s.is_dir()]
        dirs.extend(frontier)
    return dirs


def find_files(d: Path, split: str, resolution: int | None) -> list[Path]:
    found: list[Path] = []
    for sub in _walk(d):
        if not sub.is_dir():
            continue
        if split == "train":
            batches = [(int(m.group(1)), sub / m.group(0)) for p in sub.iterdir() if (m := _TRAIN_RE.match(p.name))]
            found.extend(p for _, p in sorted(batches))
        else:
            if resolution:
                names = [n.format(r=resolution) for n in VAL_NAMES]
            else:
                names = [VAL_NAMES[0], *sorted(p.name for p in sub.glob("Imagenet*_val.npz"))]
            found.extend(sub / n for n in dict.fromkeys(names) if (sub / n).is_file())
        if found:
            return found
    return found


def _class_names(files: list[Path], n: int) -> list[str]:
    for d in dict.fromkeys(p.parent for p in files):
        for m in (d / "map_clsloc.txt", d.parent / "map_clsloc.txt"):
            if m.is_file():
                names = {}
                for line in m.read_text().splitlines():
                    parts = line.split()
                    if len(parts) >= 3 and parts[1].isdigit():
                        names[int(parts[1]) - 1] = parts[2]
                if len(names) >= n:
                    return [names.get(i, str(i)) for i in range(n)]
    return [str(i) for i in range(n)]


def load_npz_batches(files: list[Path], resolution: int | None, max_classes: int | None, name: str) -> ImageData:
    # Read the (small) labels first to allocate the image array once: ImageNet32's train set is 3.7 GiB.
    labels_parts, keep_parts = [], []
    for p in files:
        with np.load(p, allow_pickle=False) as z:
            if "data" not in z.files or "labels" not in z.files:
                raise DatasetFormatError(f"{p}: expected keys 'data' and 'labels', found {z.files}")
            lab = np.asarray(z["labels"]).reshape(-1).astype(np.int64) - 1
        if lab.size and lab.min() < 0:
            raise DatasetFormatError(
                f"{p}: labels must start at 1 (downsampled-ImageNet format), found {lab.min() + 1}"
            )
        keep = lab < max_classes if max_classes is not None else None
        labels_parts.append(lab if keep is None else lab[keep])
        keep_parts.append(keep)
    total = sum(len(lab) for lab in labels_parts)
    images: np.ndarray | None = None
    pos, res = 0, resolution
    for p, keep in zip(files, keep_parts):
        with np.load(p, allow_pickle=False) as z:
            data = z["data"]
        if data.ndim != 2 or data.shape[1] % 3:
            raise DatasetFormatError(f"{p}: 'data' must be (N, 3*R*R), got {data.shape}")
        refuse_non_finite(data, str(p))
        r = int(round((data.shape[1] // 3) ** 0.5))
        if 3 * r * r != data.shape[1] or (res is not None and r != res):
            want = f"{3 * res * res} for {res}x{res}" if res else "3*R*R"
            raise DatasetFormatError(f"{p}: rows of {data.shape[1]} values, expected {want} (R, G, B planes)")
        res = r
        if keep is not None:
            data = data[keep]
        if images is None:
            images = np.empty((total, 3, r, r), dtype=np.uint8)
        images[pos : pos + len(data)] = data.reshape(-1, 3, r, r)
        pos += len(data)
    labels = np.concatenate(labels_parts) if labels_parts else np.zeros(0, np.int64)
    n_classes = max_classes or max(1000, int(labels.max()) + 1 if labels.size else 0)
    return make_image_data(images, labels, _class_names(files, n_classes), name, files=[str(p) for p in files])


def _loader(name: str, resolution: int | None):
    def load(data_dir: str | None, split: str = "train", *, max_classes: int | None = None) -> ImageData:
        check_split(split)
        searched = candidate_dirs(data_dir)
        for d in searched:
            files = find_files(d, split, resolution) if d.is_dir() else []
            if files:
                return load_npz_batches(files, resolution, max_classes, name)
        r = resolution or "R"
        val = " or ".join(n.format(r=r) for n in VAL_NAMES)
        raise not_found(
            name,
            searched,
            f"train_data_batch_1.npz ... train_data_batch_10.npz (train) and {val} (test), "
            f"keys 'data' (N, {3 * resolution * resolution if resolution else '3*R*R'}) "
            f"and 'labels' (1-based), in data_dir or up to two folders below it",
        )

    load.__name__ = name
    load.__doc__ = (
        f"Downsampled ImageNet{resolution or ''} (npz batches), uint8 (N, 3, R, R); "
        f"max_classes keeps only labels below it."
    )
    return load


imagenet16 = register("imagenet16")(_loader("imagenet16", 16))
imagenet32 = register("imagenet32")(_loader("imagenet32", 32))
imagenet64 = register("imagenet64")(_loader("imagenet64", 64))
imagenet_downsampled = register("imagenet_downsampled", "downsampled_imagenet")(_loader("imagenet_downsampled", None))
