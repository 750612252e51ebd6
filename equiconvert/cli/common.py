"""What every subcommand shares: the user-error exception and its exit status."""

from __future__ import annotations

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C


class CLIError(Exception):
    """A user error: reported as one `error: ...` line and exit status 2."""
