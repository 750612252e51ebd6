"""Progress bars for long work (conversion, basis builds, equivariance checks, training): one convention for all.

A bar appears only once its work has run for DELAY_S seconds, so quick calls stay silent. `progress=None` shows it
only when stderr is a terminal (logs, CI and piped output stay clean), True always, False never. tqdm is imported
when a bar is made, never by `import equiconvert`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from .errors import ParameterError

DELAY_S = 2.0  # seconds of work before a bar is drawn
_basis_builds: ContextVar[Any] = ContextVar("basis_builds", default=None)


def require_progress(owner: str, progress: object) -> None:
    """Refuse a `progress` that is not True, False or None (a string such as "no" would read as True)."""
    if progress is not None and not isinstance(progress, bool):
        raise ParameterError(f"{owner}: progress must be True, False or None (auto: on a terminal), got {progress!r}")


def progress_bar(
    desc: str, unit: str, progress: bool | None, total: int | None = None, initial: int = 0, leave: bool = False
) -> Any:
    """A tqdm bar on stderr, drawn after DELAY_S seconds; progress None: only when stderr is a terminal.

    leave: keep the finished bar on screen (a training run's summary) rather than erase it (a step of a longer task).
    """
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        delay=DELAY_S,
        disable=None if progress is None else not progress,
        leave=leave,
    )


@contextlib.contextmanager
def counting_basis_builds(progress: bool | None) -> Iterator[None]:
    """Count the kernel bases built (not found in a cache) inside this block on a bar of their own."""
    bar = progress_bar("bases built", "basis", progress)
    token = _basis_builds.set(bar)
    try:
        yield
    finally:
        _basis_builds.reset(token)
        bar.close()


def basis_built() -> None:
    """Tick the enclosing counting_basis_builds bar, if any."""
    bar = _basis_builds.get()
    if bar is not None:
        bar.update(1)
