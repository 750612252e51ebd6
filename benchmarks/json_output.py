"""A benchmark's JSON summary: printed, and written to --out when one is given (its folder made)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(summary: dict[str, Any], out: str | Path | None) -> str:
    """The summary as indented JSON, written to `out` (with a final newline) when `out` is set; the text."""
    text = json.dumps(summary, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return text
