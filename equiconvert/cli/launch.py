"""`train --nproc-per-node N`: start the same command on N local workers through torchrun's entry point."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Sequence

import torch

from ..errors import RunError
from .common import CLIError, exit_status_of_signal


class JobFailedError(RunError):
    """A worker of a `train --nproc-per-node` job died; the message names it and its log."""


def launch_train(args: argparse.Namespace, device: str | None = None) -> int:
    """`train --nproc-per-node N`: the same command on N local workers, started by torchrun's own entry point.

    device: the run's device (None: cuda if available, else cpu), which decides what a worker occupies."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..training import distributed

    if args.nproc_per_node < 1:
        raise CLIError(f"--nproc-per-node {args.nproc_per_node}: give at least 1 worker")
    _refuse_more_workers_than_devices(args.nproc_per_node, device)
    if distributed.launched_world_size() > 1:
        raise CLIError("--nproc-per-node starts its own workers: drop it when launching with torchrun")
    log_dir = Path(tempfile.mkdtemp(prefix="equiconvert-workers-"))  # owner-only
    failed_log: Path | None = None  # the log a failure's message names: kept for the user to read
    try:
        with _quiet("torch.distributed.elastic"):  # its own report of the failure: ours below
            distributed.launch(
                args.nproc_per_node, "equiconvert", _without_option(args.argv, "--nproc-per-node"), log_dir
            )
    except ChildFailedError as exc:
        line, failed_log = _failure(exc.failures, log_dir)
        raise JobFailedError(line) from None
    except SignalException as exc:  # Ctrl-C or SIGTERM: passed on to the workers, which stopped with a checkpoint
        return exit_status_of_signal(exc.sigval)
    finally:
        if failed_log is None:
            shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _failure(failures: dict, log_dir: Path) -> tuple[str, Path | None]:
    """One line for a failed job, naming the worker that died first (by a signal if one did: the others then lose
    it), and that worker's log (None: it wrote to the console)."""
    rank, failure = min(failures.items(), key=lambda item: (item[1].exitcode >= 0, item[1].timestamp))
    code = failure.exitcode
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    from ..training.distributed import worker_log

    log = worker_log(log_dir, rank)
    return f"worker {rank} died ({how}), see {log if log is not None else 'its messages above'}", log


@contextlib.contextmanager
def _quiet(prefix: str) -> Iterator[None]:
    """Silence every logger under `prefix` for the block: each of torch's elastic modules sets its own level, so
    the parent's does not reach them (its warnings, e.g. of the signal passed on to the workers, would reach the
    console)."""
    import torch.distributed.run  # noqa: F401  (creates its modules' loggers)

    names = [name for name in list(logging.root.manager.loggerDict) if name == prefix or name.startswith(prefix + ".")]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _refuse_more_workers_than_devices(workers: int, device: str | None) -> None:
    """Each worker takes one GPU (cuda:LOCAL_RANK) or one CPU core: more workers than that hang or oversubscribe."""
    on_cuda = device.startswith("cuda") if device is not None else torch.cuda.is_available()
    if on_cuda:
        available, what = torch.cuda.device_count(), "CUDA devices are visible (CUDA_VISIBLE_DEVICES chooses them)"
    else:
        available, what = os.cpu_count() or 1, "CPU cores are available for a CPU run"
    if workers > available:
        raise CLIError(f"--nproc-per-node {workers}: only {available} {what}; give at most {available}")


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
