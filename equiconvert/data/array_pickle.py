"""Read a pickle that may hold only plain containers and NumPy arrays: CIFAR-10's public format.

A pickle names the functions that rebuild its objects, so `pickle.load` of a crafted file runs
code. The unpickler here resolves only NumPy's array, dtype and scalar constructors (under their
NumPy 1 and NumPy 2 module paths, read with the installed NumPy's) and `_codecs.encode` (bytes
pickled by Python 3 at protocol 2); any other global is refused before it is called, so a data
folder cannot run code.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from ._base import DatasetFormatError

ALLOWED_GLOBALS = frozenset(
    {
        *(
            (f"{core}.multiarray", name)
            for core in ("numpy.core", "numpy._core")
            for name in ("_reconstruct", "scalar")
        ),
        *((f"{core}.numeric", "_frombuffer") for core in ("numpy.core", "numpy._core")),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }
)


# NumPy 2 renamed numpy.core to numpy._core; a pickle names the path of the NumPy that wrote it
_INSTALLED_CORE = "numpy._core" if int(np.__version__.split(".")[0]) >= 2 else "numpy.core"


class _ArraysOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing {module}.{name}: only NumPy arrays and plain containers are read")
        for core in ("numpy.core.", "numpy._core."):
            if module.startswith(core):
                module = f"{_INSTALLED_CORE}.{module[len(core) :]}"
        return super().find_class(module, name)


def load_array_pickle(path: Path) -> Any:
    """The object in `path` (bytes keys as in CIFAR-10's Python 2 pickles); DatasetFormatError for anything else."""
    with open(path, "rb") as f:
        try:
            return _ArraysOnlyUnpickler(f, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, ValueError, ImportError, AttributeError) as exc:
            raise DatasetFormatError(
                f"{path}: not a CIFAR-10 pickle of NumPy arrays ({exc}); use the batches of "
                "https://www.cs.toronto.edu/~kriz/cifar.html or an ImageFolder copy"
            ) from exc
