"""Command line: `equiconvert convert|demo|train|recipes|audit`, each subcommand a module of this package."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import audit, convert, demo, recipes, train
from .common import EXIT_INTERRUPTED, EXIT_USAGE, CLIError

# the subcommands, in the order `--help` lists them; each module's add_parser sets the parser's `func`
SUBCOMMANDS = (convert, demo, train, recipes, audit)

__all__ = ["CLIError", "EXIT_INTERRUPTED", "EXIT_USAGE", "SUBCOMMANDS", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="equiconvert", description="Turn CNNs into rotation/reflection-equivariant steerable CNNs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(sub)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # usage and errors name the subcommands, not `command`
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ..errors import EquiconvertError

    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --nproc-per-node passes on to its workers
    from ..privacy.interrupt import TrainingInterrupted

    try:
        return args.func(args)
    except (CLIError, EquiconvertError, ValueError) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except TrainingInterrupted as exc:
        resume = "run the same command with --resume to continue" if exc.checkpoint else "nothing was saved"
        print(f"interrupted: training stopped by Ctrl-C after step {exc.step}; {resume}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
