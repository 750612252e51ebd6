"""MNIST and Fashion-MNIST from the original IDX files (``.gz`` or uncompressed).

Looked for in ``data_dir`` itself, torchvision's layout (``data_dir/MNIST/raw``,
``data_dir/FashionMNIST/raw``) and, for Fashion-MNIST, the Debian package
``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``).
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._base import DatasetFormatError, ImageData, candidate_dirs, check_split, make_image_data, not_found, register

IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MNIST_CLASSES = [str(i) for i in range(10)]
FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
DEBIAN_FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


@dataclass(frozen=True)
class PublishedLabels:
    """A published split's labels: examples per class, and the SHA-256 of the label bytes where known.

    MNIST and Fashion-MNIST have the same file names and sizes; their labels tell them apart (MNIST's classes are
    unbalanced, Fashion-MNIST's hold 6,000 / 1,000 each), whatever the compression."""

    counts: tuple[int, ...]
    sha256: str | None = None

    def matches(self, labels: np.ndarray) -> bool:
        counts = tuple(int(c) for c in np.bincount(labels, minlength=len(self.counts)))
        if counts != self.counts:
            return False
        return self.sha256 is None or hashlib.sha256(labels.tobytes()).hexdigest() == self.sha256


# the label content of each IDX data set's published files, by data set and split (read_idx's labels)
PUBLISHED_LABELS: dict[str, dict[str, PublishedLabels]] = {
    "mnist": {
        "train": PublishedLabels((5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949)),
        "test": PublishedLabels((980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009)),
    },
    "fashion_mnist": {
        "train": PublishedLabels((6000,) * 10, "657fbd221bfc9f4198cc14b5619cc33ec57c58dd0e47af4d99d6650759e869a7"),
        "test": PublishedLabels((1000,) * 10, "3d0e6c6ea990b53b6f8f500a41cac93881d981b315f84578b7d915342ade01e9"),
    },
}

# IDX type byte -> numpy big-endian dtype
_IDX_TYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _open(path: Path):
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def read_idx(path: str | Path, expect_ndim: int | None = None) -> np.ndarray:
    """Parse an IDX file (gzip-compressed or not): magic 0x0000, type byte, ndim byte, big-endian dims.

    Raises DatasetFormatError on a bad magic number, an unexpected number of dimensions, or a
    payload whose length does not match the dimensions in the header.
    """
    path = Path(path)
    try:
        with _open(path) as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise DatasetFormatError(f"{path}: cannot be read ({exc})") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise DatasetFormatError(
            f"{path}: not an IDX file (magic bytes {raw[:4].hex() or 'missing'}; "
            f"expected 0000 followed by a type byte 08..0e and the number of dimensions)"
        )
    dtype, ndim = _IDX_TYPES[raw[2]], raw[3]
    if expect_ndim is not None and ndim != expect_ndim:
        raise DatasetFormatError(
            f"{path}: IDX file has {ndim} dimensions, expected {expect_ndim} "
            f"(magic {int.from_bytes(raw[:4], 'big')}; images are 2051, labels 2049)"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetFormatError(f"{path}: truncated IDX header")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DatasetFormatError(
            f"{path}: IDX header says shape {dims} ({expected} bytes of data) but the file "
            f"holds {len(raw) - header} bytes after the header (truncated or corrupt download?)"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=False)


def find_idx_file(d: Path, stem: str) -> Path | None:
    """``stem``, ``stem.gz`` or the ``train-images.idx3-ubyte`` spelling, uncompressed first."""
    alt = stem.replace("-idx", ".idx")
    for name in (stem, stem + ".gz", alt, alt + ".gz"):
        if (d / name).is_file():
            return d / name
    return None


def load_idx_pair(d: Path, split: str, classes: list[str], name: str) -> ImageData:
    """The split's images and labels in `d`; the labels are read (and checked) first, being 1/784 of the bytes."""
    img_stem, lbl_stem = IDX_FILES[split]
    img_path, lbl_path = find_idx_file(d, img_stem), find_idx_file(d, lbl_stem)
    labels = read_idx(lbl_path, expect_ndim=1)
    if labels.dtype != np.uint8:
        raise DatasetFormatError(f"{lbl_path}: expected unsigned-byte IDX data (type 0x08)")
    if labels.size and labels.max() >= len(classes):
        raise DatasetFormatError(f"{lbl_path}: label {labels.max()} out of range for {len(classes)} classes")
    check_published(labels, name, split, d)
    images = read_idx(img_path, expect_ndim=3)
    if images.dtype != np.uint8:
        raise DatasetFormatError(f"{img_path}: expected unsigned-byte IDX data (type 0x08)")
    if images.shape[0] != labels.shape[0]:
        raise DatasetFormatError(
            f"{img_path} holds {images.shape[0]} images but {lbl_path} holds {labels.shape[0]} labels"
        )
    return make_image_data(images[:, None], labels, classes, name, source=str(d))


def check_published(labels: np.ndarray, name: str, split: str, folder: Path) -> None:
    """A split as long as `name`'s published one must hold its labels: another data set in the same format
    (Fashion-MNIST given as MNIST) would train on one and be recorded as the other. Shorter or longer files (a
    subset, your own data in IDX format) are not the published ones and are not checked."""
    published = PUBLISHED_LABELS.get(name, {}).get(split)
    if published is None or len(labels) != sum(published.counts) or published.matches(labels):
        return
    other = next(
        (other for other, splits in PUBLISHED_LABELS.items() if other != name and splits[split].matches(labels)),
        None,
    )
    if other is not None:
        found, what_to_do = f"they hold {other}'s labels", f"load them as {other!r}, or "
    else:
        counts = np.bincount(labels, minlength=len(published.counts)).tolist()
        found, what_to_do = f"examples per class {counts}, published {list(published.counts)}", ""
    raise DatasetFormatError(
        f"{folder}: the {split} files there are not {name}'s ({found}); {what_to_do}point data_dir at "
        f"{name}'s IDX files"
    )


def _idx_dirs(d: Path, torchvision_name: str, extra: tuple[str, ...]) -> list[Path]:
    return [d, d / torchvision_name / "raw", d / torchvision_name, *(d / e for e in extra)]


def _load_idx_dataset(
    name: str,
    data_dir: str | None,
    split: str,
    torchvision_name: str,
    extra: tuple[str, ...],
    defaults: tuple[str, ...],
    classes: list[str],
    hint: str = "",
) -> ImageData:
    check_split(split)
    searched: list[Path] = []
    for base in candidate_dirs(data_dir, defaults):
        for d in _idx_dirs(base, torchvision_name, extra):
            searched.append(d)
            if all(find_idx_file(d, s) for s in IDX_FILES[split]):
                return load_idx_pair(d, split, classes, name)
    want = ", ".join(f"{s}.gz" for sp in ("train", "test") for s in IDX_FILES[sp])
    dirs = [d for d in searched if d.is_dir()] or searched[:1]
    how = [hint] if hint else []
    for d in dirs:
        present = [s for s in IDX_FILES[split] if find_idx_file(d, s)]
        if present:
            how.insert(0, f"{d} has {', '.join(present)} but not all of the {split} files.")
    raise not_found(
        name,
        searched,
        f"the IDX files {want} (gzip-compressed or not), in the directory itself "
        f"or in {torchvision_name}/raw/ (torchvision's layout)",
        "\n".join(how),
    )


@register("fashion_mnist", "fashionmnist", "fmnist")
def fashion_mnist(data_dir: str | None, split: str = "train") -> ImageData:
    """Fashion-MNIST (60k/10k, 1x28x28). Without data_dir: $EQUICONVERT_DATA_DIR, then the Debian
    package's /usr/share/datasets/fashion-mnist (``apt-get install dataset-fashion-mnist``)."""
    return _load_idx_dataset(
        "fashion_mnist",
        data_dir,
        split,
        "FashionMNIST",
        ("fashion-mnist", "fashion_mnist"),
        (DEBIAN_FASHION_MNIST,),
        FASHION_MNIST_CLASSES,
        f"On Debian/Ubuntu, `apt-get install dataset-fashion-mnist` puts them in "
        f"{DEBIAN_FASHION_MNIST} (found there without data_dir).",
    )


@register("mnist")
def mnist(data_dir: str | None, split: str = "train") -> ImageData:
    """MNIST (60k/10k, 1x28x28) from the IDX files in data_dir (or torchvision's MNIST/raw)."""
    return _load_idx_dataset("mnist", data_dir, split, "MNIST", ("mnist",), (), MNIST_CLASSES)
