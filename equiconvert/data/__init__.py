"""Data sets loaded whole into memory as raw uint8 tensors.

``load_dataset(name, data_dir, split)`` returns an :class:`ImageData`: ``images`` uint8
(N, C, H, W), ``labels`` int64 (N,), ``classes`` and ``name``. Nothing is downloaded: each
loader reads the public format that users already have and, when the files are missing, raises
:class:`DatasetNotFoundError` naming the directories searched and the files expected there.
Augmentation and normalisation are done on the training device, in batches.

Registered data sets (``DATASETS``): ``cifar10`` (pickle batches or ImageFolder), ``mnist``,
``fashion_mnist`` (IDX files; Debian's /usr/share/datasets/fashion-mnist by default),
``rotated_mnist`` (npz of digits or IDX), ``imagenet16/32/64`` and ``imagenet_downsampled``
(npz batches), ``imagefolder`` (users' own images) and ``synthetic``.

With ``data_dir=None`` a loader looks in ``$EQUICONVERT_DATA_DIR`` and its own defaults.
Decoded image folders are cached in the ``datasets`` folder of equiconvert's cache
(:func:`equiconvert.cache.cache_root`: ``$EQUICONVERT_CACHE_DIR``, else ``$XDG_CACHE_HOME/equiconvert``, else
``~/.cache/equiconvert``).
"""

from __future__ import annotations

import os

from ._base import (
    DATASETS,
    SPLITS,
    DatasetFormatError,
    DatasetNotFoundError,
    ImageData,
    UnknownDatasetError,
    cache_dir,
    register,
    resolve_name,
    select_classes,
)
from . import cifar, imagefolder, imagenet, mnist, rotated_mnist, synthetic  # noqa: F401  (fill DATASETS)
from .imagefolder import decode_images, load_image_folder
from .mnist import read_idx
from .rotated_mnist import rotate_images

__all__ = [
    "DATASETS",
    "SPLITS",
    "DatasetFormatError",
    "DatasetNotFoundError",
    "ImageData",
    "UnknownDatasetError",
    "cache_dir",
    "decode_images",
    "load_dataset",
    "load_image_folder",
    "read_idx",
    "register",
    "rotate_images",
    "select_classes",
]


def load_dataset(name: str, data_dir: str | os.PathLike | None = None, split: str = "train", **kwargs) -> ImageData:
    """Load one split ("train" or "test") of a registered data set; ``kwargs`` go to its loader.

    Names are case-, dash- and underscore-insensitive ("Fashion-MNIST" == "fashion_mnist").
    """
    loader = DATASETS[resolve_name(name)]
    return loader(None if data_dir is None else os.fspath(data_dir), split, **kwargs)
