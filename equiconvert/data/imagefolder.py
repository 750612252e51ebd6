"""ImageFolder layouts (``root/train/<class>/*``, ``root/test/<class>/*``, or one ``root/<class>/*``).

Images are decoded once with a thread pool (PIL releases the GIL while decoding; RGB JPEGs go
through torchvision's batched libjpeg-turbo decoder, which gives PIL's bytes faster) and the
decoded uint8 arrays are cached as an ``.npz`` in :func:`~equiconvert.data._base.cache_dir`,
keyed by the folder's resolved path, the modification times of the folder and its class
folders, the number of files and the decoding options. Adding, removing or replacing a file
changes a class folder's mtime, so the cache is rebuilt; delete the cache directory to force it.

All images of a split must have one size, unless ``image_size=`` is given, in which case every
image is resized with PIL (bilinear) to that (height, width).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

try:  # torchvision >= 0.19 decodes lists of JPEGs in C++; optional, PIL is the reference path
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # pragma: no cover
    decode_jpeg = None

from ..errors import ParameterError
from ._base import (
    DatasetFormatError,
    ImageData,
    cache_dir,
    cache_key,
    cache_load,
    cache_save,
    check_split,
    make_image_data,
    not_found,
    register,
)

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".pbm", ".tif", ".tiff", ".webp", ".gif")
SPLIT_DIR_NAMES = {"train": ("train", "training"), "test": ("test", "val", "valid", "validation")}
_GREY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F")

SizeArg = int | Sequence[int] | None


def _hw(image_size: SizeArg) -> tuple[int, int] | None:
    if image_size is None:
        return None
    if isinstance(image_size, int):
        return (image_size, image_size)
    h, w = image_size
    return (int(h), int(w))


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def class_dirs(split_dir: Path) -> list[str]:
    """Sorted names of the class sub-folders (hidden ones skipped), as torchvision's ImageFolder."""
    return sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))


def list_files(split_dir: Path, classes: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """All image files of ``split_dir/<class>/`` in (class, file name) order, and their labels."""
    index = {c: i for i, c in enumerate(classes)}
    files: list[str] = []
    labels: list[int] = []
    for c in class_dirs(split_dir):
        if c not in index:
            raise DatasetFormatError(f"{split_dir / c}: class folder {c!r} is not among the classes {list(classes)}")
        folder = os.path.join(split_dir, c)
        names = sorted(e.name for e in os.scandir(folder) if _is_image(e.name) and e.is_file())
        files.extend([os.path.join(folder, n) for n in names])
        labels.extend([index[c]] * len(names))
    return files, np.asarray(labels, dtype=np.int64)


def _channels_of(mode: str) -> int:
    return 1 if mode in _GREY_MODES else 3


def _read_one(path: str, channels: int, size_hw: tuple[int, int], resize: bool) -> np.ndarray:
    """Decode one file to (H, W, C) uint8; raises DatasetFormatError when it has another size."""
    try:
        with Image.open(path) as im:
            mode = "L" if channels == 1 else "RGB"
            if resize and im.size != (size_hw[1], size_hw[0]):
                if im.mode != mode:
                    im = im.convert(mode)
                im = im.resize((size_hw[1], size_hw[0]), Image.Resampling.BILINEAR)
            elif im.size != (size_hw[1], size_hw[0]):
                raise DatasetFormatError(
                    f"{path}: image is {im.size[1]}x{im.size[0]} (HxW) but the first image of the folder is "
                    f"{size_hw[0]}x{size_hw[1]}; all images must have one size. Pass image_size=(H, W) to "
                    f"resize every image on loading, or resize the files."
                )
            elif im.mode != mode:
                im = im.convert(mode)
            else:
                im.load()
            arr = np.asarray(im, dtype=np.uint8)
    except DatasetFormatError:
        raise
    except Exception as exc:  # PIL raises several types for broken files
        raise DatasetFormatError(f"{path}: cannot be decoded as an image ({exc})") from exc
    return arr.reshape(size_hw[0], size_hw[1], channels)


def _jpeg_batch(files: Sequence[str], start: int, stop: int, out: np.ndarray) -> bool:
    """Fast path: decode a run of RGB JPEGs with torchvision's batched libjpeg-turbo decoder.

    On CIFAR-10's JPEGs it gives the same bytes as PIL at a fraction of the per-file Python cost.
    Returns False (the caller then uses PIL file by file, with its precise errors) if any file is
    not a JPEG, is not 3-channel, has another size, or fails to decode.
    """
    if decode_jpeg is None or not all(files[i].lower().endswith((".jpg", ".jpeg")) for i in range(start, stop)):
        return False
    try:
        blobs = []
        for i in range(start, stop):
            with open(files[i], "rb") as f:
                blobs.append(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))
        # UNCHANGED keeps the stored channels: grey or CMYK JPEGs fall back to PIL's conversion.
        decoded = decode_jpeg(blobs, mode=ImageReadMode.UNCHANGED)
    except (RuntimeError, ValueError, OSError):
        return False
    if any(t.shape != out.shape[1:] for t in decoded):
        return False
    out[start:stop] = torch.stack(decoded).numpy()
    return True


def decode_images(
    files: Sequence[str], image_size: SizeArg = None, channels: int | None = None, num_workers: int | None = None
) -> np.ndarray:
    """Decode ``files`` into one (N, C, H, W) uint8 array with a thread pool.

    Without ``image_size`` every file must have the size of the first one; ``channels`` (1 or 3)
    defaults to the first file's (grey modes give 1, everything else RGB).
    """
    if not files:
        raise DatasetFormatError("no image files to decode")
    size_hw = _hw(image_size)
    with Image.open(files[0]) as first:
        if channels is None:
            channels = _channels_of(first.mode)
        if size_hw is None:
            size_hw = (first.size[1], first.size[0])
    if channels not in (1, 3):
        raise ParameterError(f"channels must be 1 or 3, got {channels}")
    resize = image_size is not None
    out = np.empty((len(files), channels, size_hw[0], size_hw[1]), dtype=np.uint8)
    workers = max(1, num_workers if num_workers is not None else (os.cpu_count() or 1))
    step = max(64, min(1024, -(-len(files) // (4 * workers))))

    def work(start: int) -> None:
        stop = min(start + step, len(files))
        if not resize and channels == 3 and _jpeg_batch(files, start, stop, out):
            return
        for i in range(start, stop):
            out[i] = _read_one(files[i], channels, size_hw, resize).transpose(2, 0, 1)

    starts = range(0, len(files), step)
    if workers == 1:
        for s in starts:
            work(s)
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="equiconvert-decode") as ex:
            for _ in ex.map(work, starts):  # re-raises the first failing chunk's error, in file order
                pass
    return out


def _folder_stamp(split_dir: Path) -> list[tuple[str, int]]:
    dirs = [split_dir] + [split_dir / c for c in class_dirs(split_dir)]
    return [(d.name, d.stat().st_mtime_ns) for d in dirs]


def load_folder(
    split_dir: str | os.PathLike,
    classes: Sequence[str] | None = None,
    *,
    image_size: SizeArg = None,
    channels: int | None = None,
    cache: bool = True,
    num_workers: int | None = None,
    name: str = "imagefolder",
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Decode every image of ``split_dir/<class>/*`` (cached), returning (images NCHW, labels, classes)."""
    split_dir = Path(split_dir).expanduser().resolve()
    classes = list(classes) if classes is not None else class_dirs(split_dir)
    files, labels = list_files(split_dir, classes)
    if not files:
        raise not_found(name, [split_dir], f"image files ({', '.join(IMAGE_EXTENSIONS)}) in {split_dir}/<class>/")
    key = cache_key(
        "imagefolder-v1",
        str(split_dir),
        _folder_stamp(split_dir),
        len(files),
        tuple(classes),
        _hw(image_size),
        channels,
    )
    path = cache_dir() / f"{name}-{split_dir.name}-{key}.npz"
    if cache:
        hit = cache_load(path)
        if hit is not None and len(hit.get("labels", ())) == len(files):
            return hit["images"], hit["labels"], [str(c) for c in hit["classes"]]
    images = decode_images(files, image_size=image_size, channels=channels, num_workers=num_workers)
    if cache:
        cache_save(path, images=images, labels=labels, classes=np.asarray(classes, dtype=str))
    return images, labels, classes


def find_split_dir(root: Path, split: str) -> Path | None:
    for n in SPLIT_DIR_NAMES[split]:
        if (root / n).is_dir():
            return root / n
    return None


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices (train, test): each class's examples shuffled with ``seed``, ``test_fraction`` of them to test."""
    if not 0.0 < test_fraction < 1.0:
        raise ParameterError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(len(idx) * test_fraction))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def load_image_folder(
    root: str | os.PathLike,
    split: str = "train",
    *,
    image_size: SizeArg = None,
    channels: int | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    cache: bool = True,
    num_workers: int | None = None,
    name: str = "imagefolder",
) -> ImageData:
    """Load one split of an ImageFolder tree.

    - ``root/train/<class>/*`` and ``root/test/<class>/*`` (``val``/``validation`` also name the
      test split): classes are the sorted union of both splits' class folders, so labels agree.
    - Otherwise ``root/<class>/*`` is split per class with ``test_fraction`` and ``seed``.
    """
    check_split(split)
    root = Path(root).expanduser()
    if not root.is_dir():
        raise not_found(
            name,
            [root],
            "root/train/<class>/*.jpg|png and root/test/<class>/*.jpg|png, "
            "or root/<class>/*.jpg|png (split by test_fraction)",
        )
    train_dir, test_dir = find_split_dir(root, "train"), find_split_dir(root, "test")
    opts = dict(image_size=image_size, channels=channels, cache=cache, num_workers=num_workers, name=name)
    if train_dir is not None or test_dir is not None:
        split_dir = train_dir if split == "train" else test_dir
        if split_dir is None:
            raise not_found(
                name,
                [root],
                f"a {'/'.join(SPLIT_DIR_NAMES[split])} folder with <class>/ sub-folders "
                f"next to {(train_dir or test_dir).name}/",
            )
        classes = sorted(set().union(*(class_dirs(d) for d in (train_dir, test_dir) if d is not None)))
        images, labels, classes = load_folder(split_dir, classes, **opts)
        return make_image_data(images, labels, classes, name, source=str(split_dir))
    classes = class_dirs(root)
    if not classes:
        raise not_found(name, [root], "root/train/<class>/*, root/test/<class>/* or root/<class>/* image files")
    images, labels, classes = load_folder(root, classes, **opts)
    train_idx, test_idx = stratified_split(labels, test_fraction, seed)
    idx = train_idx if split == "train" else test_idx
    return make_image_data(
        images[idx], labels[idx], classes, name, source=str(root), test_fraction=test_fraction, seed=seed
    )


@register("imagefolder", "folder", "image_folder")
def imagefolder(data_dir: str | None, split: str = "train", **kwargs) -> ImageData:
    """Users' own images: see :func:`load_image_folder` for the layouts and options."""
    if data_dir is None:
        raise not_found("imagefolder", [], "root/train/<class>/*, root/test/<class>/* or root/<class>/*")
    return load_image_folder(data_dir, split, **kwargs)
