"""The one-line error of a CLI call that must fail (exit status 2, no traceback), for the privacy tests."""

from __future__ import annotations

from equiconvert.cli import main


def run_error(capsys, *argv: str) -> str:
    """The `error: ...` line of `equiconvert *argv`; warnings may precede it on stderr."""
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in captured.err, captured.err
    return errors[0]
