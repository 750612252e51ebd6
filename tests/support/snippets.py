"""Running the Python blocks of the README and the guides as written: the blocks, and the warnings the library
itself issues while one runs (a snippet that trips the library's own warnings teaches a setting it warns about)."""

from __future__ import annotations

import contextlib
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@contextlib.contextmanager
def library_warnings() -> Iterator[list[str]]:
    """The messages of the warnings equiconvert's own modules issue inside the block (others' are let through)."""
    issued: list[str] = []
    original = warnings.warn

    def recording(message, *args, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] == "equiconvert":
            issued.append(str(message))
        return original(message, *args, **kwargs)

    warnings.warn = recording
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield issued
    finally:
        warnings.warn = original
