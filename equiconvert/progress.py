"""Progress bars for long work (conversion, basis builds, equivariance checks, training): one convention for all.

A bar appears only once its work has run for DELAY_S seconds, so quick calls stay silent. `progress=None` shows it
only when stderr is a terminal (logs, CI and piped output stay clean), True always, False never. tqdm is imported
when a bar is made, never by `import equiconvert`.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from .errors import ParameterError

DELAY_S = 2.0  # seconds of work before a bar is drawn
STEP_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} {unit}s{postfix}"  # no time, no rate
STEP_BAR_REDRAWS = 100  # redraws of a step bar over a run, in a stream that is not a terminal
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


def private_steps_bar(desc: str, progress: bool | None, total: int, initial: int = 0, step_times: bool = False) -> Any:
    """The bar of a DP-SGD run: the steps done and, as its postfix, the epsilon spent: what the guarantee covers.

    A step's duration grows with its secret Poisson batch size, so the bar shows no elapsed time or rate unless
    `step_times` (the run's log_step_times opt-in) and stderr is a terminal. Outside a terminal (a job log, nohup)
    the lines it leaves are drawn every total / STEP_BAR_REDRAWS steps, never by the clock, so which steps were
    drawn says nothing of their durations either.
    """
    terminal = sys.stderr.isatty()
    if step_times and terminal:
        return progress_bar(desc, "step", progress, total=total, initial=initial, leave=True)
    from tqdm.auto import tqdm

    redraws = (
        {"delay": DELAY_S, "miniters": 1}
        if terminal
        else {
            "delay": 0,
            "mininterval": 0,
            "maxinterval": math.inf,
            "miniters": max(1, total // STEP_BAR_REDRAWS),
        }
    )
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="step",
        bar_format=STEP_BAR_FORMAT,
        disable=None if progress is None else not progress,
        leave=True,
        **redraws,
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
