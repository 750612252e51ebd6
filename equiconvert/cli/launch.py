"""`train --nproc-per-node N`: start the same command on N local workers through torchrun's entry point."""

from __future__ import annotations

import argparse
from typing import Sequence

from .common import CLIError


def launch_train(args: argparse.Namespace) -> int:
    """`train --nproc-per-node N`: the same command on N local workers, started by torchrun's own entry point."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..privacy import distributed

    if args.nproc_per_node < 1:
        raise CLIError(f"--nproc-per-node {args.nproc_per_node}: give at least 1 worker")
    if distributed.launched_world_size() > 1:
        raise CLIError("--nproc-per-node starts its own workers: drop it when launching with torchrun")
    try:
        distributed.launch(args.nproc_per_node, "equiconvert", _without_option(args.argv, "--nproc-per-node"))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise CLIError(f"training worker {rank} exited with code {failure.exitcode}; its error is above") from exc
    return 0


def _without_option(argv: Sequence[str], flag: str) -> list[str]:
    """`argv` without `flag VALUE` / `flag=VALUE`."""
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == flag:
            skip = True
        elif not item.startswith(flag + "="):
            kept.append(item)
    return kept
