"""A stand-in for kill -9: a copy of a run folder taken as the run stands at the end of a step."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from equiconvert.training.callbacks import Callback


class CopyOutAfter(Callback):
    """Copies `source` to `target` at the end of step `step` (before that step's own checkpoint, if any): the
    folder a run killed then leaves, to resume from."""

    def __init__(self, step: int, source: Path, target: Path) -> None:
        self.step, self.source, self.target = step, source, target

    def on_step_end(self, trainer: Any, record: dict[str, Any]) -> None:
        if trainer.step == self.step:
            shutil.copytree(self.source, self.target)
