"""What every subcommand shares: the user-error exception and its exit status."""

from __future__ import annotations

EXIT_USAGE = 2


class CLIError(Exception):
    """A user error: reported as one `error: ...` line and exit status 2."""
