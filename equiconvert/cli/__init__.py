"""Command line: `equiconvert convert|demo|train|recipes|audit`, each subcommand a module of this package.

Only the subcommand being run is imported, so `equiconvert --help` and `--version` stay fast; a subcommand's parser
loads no torch (its choices and defaults come from torch-free modules), so its `--help` is fast too, and its
command imports torch once the arguments are parsed."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection
from typing import Sequence

from .._version import __version__
from ..errors import EquiconvertError
from .commands import SUBCOMMANDS
from .common import (
    EXIT_CODES,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CLIError,
    exit_code,
    exit_status_of_signal,
    flag_message,
)

__all__ = ["CLIError", "EXIT_CODES", "EXIT_INTERRUPTED", "EXIT_USAGE", "SUBCOMMANDS", "main"]


def _parser(commands: Collection[str] = tuple(SUBCOMMANDS)) -> argparse.ArgumentParser:
    """The parser, with the full options of `commands` (each module's add_parser sets `func`); the others are
    listed by name and help only."""
    parser = argparse.ArgumentParser(
        prog="equiconvert", description="Turn CNNs into rotation/reflection-equivariant steerable CNNs."
    )
    parser.add_argument("--version", action="version", version=f"equiconvert {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help in SUBCOMMANDS.items():
        if name in commands:
            importlib.import_module(f".{name}", __name__).add_parser(sub)
        else:
            sub.add_parser(name, help=help)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # usage and errors name the subcommands, not `command`
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((item for item in argv if not item.startswith("-")), None)  # the top level has no valued option
    args = _parser({command} & set(SUBCOMMANDS)).parse_args(argv)
    args.argv = argv  # what --nproc-per-node passes on to its workers
    from ..training.interrupt import TrainingInterrupted

    try:
        return args.func(args)
    except EquiconvertError as exc:
        print(f"error: {flag_message(exc)}", file=sys.stderr)
        return exit_code(exc)
    except TrainingInterrupted as exc:
        resume = "run the same command with --resume to continue" if exc.checkpoint else "nothing was saved"
        print(f"interrupted: training stopped by {exc.signal_name} after step {exc.step}; {resume}", file=sys.stderr)
        return exit_status_of_signal(exc.signum)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
