"""The output folder of `equiconvert train`: one run per folder.

A folder that holds an earlier run would get its log appended to and its evaluations
mixed into the new result.json, so it is refused unless the run resumes it (which needs
its checkpoint) or is asked to overwrite it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from ..privacy.checkpoint import remove_stale_temporaries
from .loggers import CSV_FILE, JSONL_FILE

CHECKPOINT = "checkpoint.pt"
RUN_RECORDS = (JSONL_FILE, CSV_FILE, "result.json", CHECKPOINT)  # what a run that has started leaves behind
RUN_FILES = (*RUN_RECORDS, "model.txt")  # everything a run writes (and --overwrite removes)


class OutputFolderError(UsageError, ValueError):
    """`out` cannot be used as asked (it holds another run, there is nothing to resume, it cannot be created)."""


# why an empty output path is refused: Path("") is the current folder, which the run would fill without a word
EMPTY_OUT_RULE = "names no folder (an empty path is the current folder): give the run's output folder"


def names_no_folder(out: str | Path | None) -> bool:
    """Whether `out` is an empty path (checked before it becomes a Path, which reads "" as ".")."""
    return out is not None and str(out) == ""


def create_out(out: Path) -> None:
    """Create the output folder (and its parents), or say in one line why it cannot be."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputFolderError(
            f"out={out} cannot be created ({error.strerror or error}): give a folder this user can write to"
        ) from None


def prepare_out(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse an `out` holding a run's files unless resuming (its checkpoint must exist) or overwriting (they go).

    Other files (a benchmark's own notes beside the run) neither count nor are removed.
    """
    if resume and overwrite:
        raise OutputFolderError(
            "resume=True and overwrite=True exclude each other: resume the run in out, or replace it"
        )
    if resume:
        if not (out / CHECKPOINT).is_file():
            raise OutputFolderError(
                f"resume=True: there is no checkpoint at {out / CHECKPOINT}; drop resume=True to start a new run"
            )
        return
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputFolderError(f"out={out} is a file, not a folder")
    if overwrite:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
        remove_stale_temporaries(out / CHECKPOINT)
        return
    earlier = [name for name in RUN_RECORDS if (out / name).exists()]
    if earlier:
        raise OutputFolderError(
            f"out={out} is not empty: it holds an earlier run ({', '.join(earlier)}); give "
            "resume=True to continue it, overwrite=True to replace it, or another out="
        )
