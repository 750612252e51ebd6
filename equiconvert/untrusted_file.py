"""Reading a file nobody vouches for: torch.load(weights_only=True), with every failure of it reported as one error.

A damaged or crafted file can make the weights-only unpickler fail with almost any exception (UnpicklingError,
IndexError, KeyError, struct.error, UnicodeDecodeError, ...). Torch's text for some of them suggests
weights_only=False, which would run the file's code, so callers show their own message and keep torch's as the cause.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from .errors import UnreadableFileError


def load_weights_only(path: str | Path, **load_kwargs: Any) -> Any:
    """The file's contents, loaded without running any of its code; a missing file is FileNotFoundError."""
    try:
        with warnings.catch_warnings():  # torch's note on the pickle protocol of a foreign file
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, weights_only=True, **load_kwargs)
    except FileNotFoundError:
        raise
    except Exception as error:  # any failure of a hostile or damaged file, whatever the unpickler raised
        raise UnreadableFileError(
            f"{path} cannot be read with torch.load(weights_only=True) ({type(error).__name__}): it is damaged or not "
            "a file of the kind asked for"
        ) from error
