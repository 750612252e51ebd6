"""Shared pieces of the data loaders: the result type, the registry, errors, paths, the cache."""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from equiconvert.cache import cache_root, disk_cache_enabled
from ..errors import DataError, NameMismatchError, ParameterError

SPLITS = ("train", "test")


class DatasetNotFoundError(DataError, FileNotFoundError):
    """The files of a data set are not where they were looked for; the message says where to put them."""


class UnknownDatasetError(NameMismatchError):
    """No data set is registered under the name given."""


class DatasetFormatError(DataError, ValueError):
    """A data file exists but is not in the expected format (bad header, wrong size, mixed image sizes...)."""


@dataclass
class ImageData:
    """A whole split in memory: uint8 images (N, C, H, W), int64 labels (N,), class names, data set name.

    Images are raw uint8 (no normalisation, no augmentation): those happen on the training
    device, in batches.
    """

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    name: str
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise DatasetFormatError(
                f"{self.name}: images must be a uint8 tensor (N, C, H, W), "
                f"got {self.images.dtype} of shape {tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise DatasetFormatError(
                f"{self.name}: labels must be an int64 tensor of shape ({self.images.shape[0]},), "
                f"got {self.labels.dtype} of shape {tuple(self.labels.shape)}"
            )
        if len(self.labels) and (int(self.labels.min()) < 0 or int(self.labels.max()) >= len(self.classes)):
            raise DatasetFormatError(
                f"{self.name}: labels must lie in [0, {len(self.classes)}), "
                f"got [{int(self.labels.min())}, {int(self.labels.max())}]"
            )

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images, self.labels

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (
            f"ImageData(name={self.name!r}, n={len(self)}, image_shape={self.image_shape}, classes={self.num_classes})"
        )


def make_image_data(images: np.ndarray, labels: np.ndarray, classes: Sequence[str], name: str, **meta) -> ImageData:
    """Wrap numpy arrays (images N,C,H,W uint8) without copying where possible.

    Float images must be finite and integer-valued labels integers: a cast to uint8/int64 would
    silently turn NaN or 2.5 into some value. Errors name the source (meta["source"]) and index.
    """
    _check_arrays(np.asarray(images), np.asarray(labels), f"{name} ({meta['source']})" if "source" in meta else name)
    images = np.ascontiguousarray(images, dtype=np.uint8)
    labels = np.ascontiguousarray(labels, dtype=np.int64)
    if not images.flags.writeable:  # e.g. np.frombuffer over file bytes: torch wants writable memory
        images = images.copy()
    if not labels.flags.writeable:
        labels = labels.copy()
    return ImageData(torch.from_numpy(images), torch.from_numpy(labels), [str(c) for c in classes], name, dict(meta))


def select_classes(data: ImageData, classes: Sequence[int] | None, parameter: str = "classes") -> ImageData:
    """`data` with only the examples whose label is in `classes` (None: `data` itself); the class list is kept whole,
    so a model keeps one logit per class of the data set. `parameter` names the setting in errors."""
    if classes is None:
        return data
    if not classes or any(not 0 <= label < len(data.classes) for label in classes):
        raise ParameterError(
            f"{parameter}={list(classes)}: give labels of {data.name} in 0..{len(data.classes) - 1} (its classes: "
            f"{', '.join(data.classes)})"
        )
    keep = torch.isin(data.labels, torch.tensor(list(classes)))
    return ImageData(data.images[keep], data.labels[keep], data.classes, data.name, dict(data.meta))


def refuse_non_finite(images: np.ndarray, where: str) -> None:
    """Float images (before any cast to uint8, which would turn NaN into some pixel value) must be finite."""
    if images.dtype.kind in "fc" and len(images):
        finite = np.isfinite(images.reshape(len(images), -1)).all(axis=1)
        if not finite.all():
            raise DatasetFormatError(
                f"{where}: image {int(np.flatnonzero(~finite)[0])} holds a non-finite value "
                f"(NaN or inf; {int((~finite).sum())} such images): clean the file"
            )


def _check_arrays(images: np.ndarray, labels: np.ndarray, where: str) -> None:
    refuse_non_finite(images, where)
    if labels.dtype.kind not in "iu":
        raise DatasetFormatError(f"{where}: labels have dtype {labels.dtype}; integer class indices are required")
    if len(labels) != len(images):
        raise DatasetFormatError(f"{where}: {len(images)} images but {len(labels)} labels")


# ----------------------------------------------------------------------------- registry

Loader = Callable[..., ImageData]
DATASETS: dict[str, Loader] = {}
_ALIASES: dict[str, str] = {}


def _normalise_name(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "").replace(" ", "")


def register(name: str, *aliases: str) -> Callable[[Loader], Loader]:
    """Decorator: register `fn(data_dir, split, **kwargs) -> ImageData` under `name` (and aliases)."""

    def deco(fn: Loader) -> Loader:
        if name in DATASETS:
            raise ParameterError(f"data set {name!r} is registered twice")
        DATASETS[name] = fn
        for key in (name, *aliases):
            _ALIASES[_normalise_name(key)] = name
        return fn

    return deco


def resolve_name(name: str) -> str:
    key = _normalise_name(name)
    if key not in _ALIASES:
        raise UnknownDatasetError(f"dataset={name}: unknown data set; known: {', '.join(sorted(DATASETS))}")
    return _ALIASES[key]


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ParameterError(f"split must be one of {SPLITS}, got {split!r}")
    return split


# ----------------------------------------------------------------------------- paths


def candidate_dirs(data_dir: str | os.PathLike | None, defaults: Iterable[str | os.PathLike] = ()) -> list[Path]:
    """Where to look: the given directory, else $EQUICONVERT_DATA_DIR and the loader's defaults."""
    if data_dir is not None:
        return [Path(data_dir).expanduser()]
    out: list[Path] = []
    env = os.environ.get("EQUICONVERT_DATA_DIR")
    if env:
        out.append(Path(env).expanduser())
    out.extend(Path(d).expanduser() for d in defaults)
    return out


def not_found(dataset: str, searched: Sequence[Path], expected: str, how: str = "") -> DatasetNotFoundError:
    where = "\n".join(f"  - {p}" + ("" if p.exists() else " (does not exist)") for p in searched)
    if not searched:
        where = "  (no directory given: pass data_dir=... or set $EQUICONVERT_DATA_DIR)"
    msg = (
        f"{dataset}: data files not found. Looked in:\n{where}\n"
        f"Expected: {expected}\n"
        f"Put the files in a directory and pass it as data_dir (or set $EQUICONVERT_DATA_DIR); "
        f"nothing is downloaded at run time."
    )
    if how:
        msg += f"\n{how}"
    return DatasetNotFoundError(msg)


# ----------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """The data sets' folder in equiconvert's cache (see equiconvert.cache.cache_root)."""
    return cache_root() / "datasets"


def cache_key(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


def cache_load(path: Path) -> dict[str, np.ndarray] | None:
    """The arrays cached at `path`; None when absent, unreadable or the disk cache is off ($EQUICONVERT_NO_CACHE)."""
    if not disk_cache_enabled() or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as exc:  # a truncated or foreign file: ignore it, it gets rewritten
        warnings.warn(f"ignoring unreadable data cache {path}: {exc}", stacklevel=3)
        return None


def cache_save(path: Path, **arrays: np.ndarray) -> bool:
    """Write atomically (temporary file + rename); a read-only cache directory only warns; off: nothing written."""
    if not disk_cache_enabled():
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp.npz")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True
    except OSError as exc:
        warnings.warn(f"could not write the data cache {path}: {exc}", stacklevel=3)
        return False
