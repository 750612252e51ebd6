"""The one-line error of a CLI call that must fail (its category's exit status, no traceback), for the privacy tests."""

from __future__ import annotations

from equiconvert.cli import main


def run_error(capsys, *argv: str, code: int = 2) -> str:
    """The `error: ...` line of `equiconvert *argv`, which exits with `code` (2: a usage error); warnings may precede
    it on stderr."""
    assert main(list(argv)) == code
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in captured.err, captured.err
    return errors[0]
