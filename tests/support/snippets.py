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
    """The messages of the warnings equiconvert's own modules issue inside the block and the filters then in force
    let through (a warning the library itself silences does not count; other packages' warnings are not listed)."""
    issued: list[str] = []
    ours: set[str] = set()
    original = warnings.warn

    def recording(message, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").split(".")[0] == "equiconvert":
            ours.add(str(message))
        return original(message, *args, **kwargs)

    warnings.warn = recording
    try:
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            yield issued
    finally:
        warnings.warn = original
    issued += [str(w.message) for w in shown if str(w.message) in ours]
