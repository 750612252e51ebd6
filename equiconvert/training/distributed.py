"""Data-parallel DP-SGD on torch.distributed: who samples what, what is reduced, who writes.

* Sampling: rank r holds the shard of training indices r, r + W, r + 2W, ... (W ranks) and Poisson-samples it
  at the global rate q = batch_size / N, so in each logical step every example joins independently with
  probability q, on exactly one rank; the accountant uses that q.
* Gradients: per-example gradients never leave their rank. Each rank clips and sums its own; the ranks
  all-reduce (sum) those sums. The Gaussian noise N(0, (sigma C)^2) enters each step once for the whole job:
  rank 0 adds it to its local sum before the all-reduce, and its noise generator is the job's only one.
* State: every rank applies the same reduced gradient, so parameters, optimizer state, EMA and privacy ledger
  stay identical without further communication. A checkpoint (written by rank 0) holds the state of every
  rank's own generators (sampler, augmentation, torch), gathered with all_gather_object.
* Outputs: only rank 0 writes the log, checkpoints and results. Evaluation is sharded: each rank scores a
  contiguous slice of the evaluation set and the logits are all-gathered, so every rank reports the metrics of
  the whole set.

A run is launched by torchrun (or `equiconvert train --nproc-per-node N`, which calls torchrun's own entry
point); `from_environment` joins the process group torchrun describes: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ParameterError, RunError
from .worker_lifetime import die_with_parent, launcher_environment

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}  # device type -> torch.distributed backend
# seconds the workers of a `--nproc-per-node` job get, after Ctrl-C or SIGTERM, to finish their step and write the
# checkpoint before the launcher kills them (torchrun's own default, 30 s, can be shorter than one step); a second
# Ctrl-C kills them at once
STOP_GRACE_S = 300


@dataclass(frozen=True)
class DistributedContext:
    """This process's place in the job (world size 1: a single process, no communication at all)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    host_group: Any = None  # a gloo group for values the hosts exchange (NCCL jobs); None: the default group

    @property
    def is_main(self) -> bool:
        """Rank 0: the only noise generator and the only writer of outputs."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard(self) -> tuple[int, int]:
        """(rank, world_size): this rank samples the training indices rank, rank + world_size, ..."""
        return self.rank, self.world_size

    def rank_seed(self, seed: int) -> int:
        """This rank's seed for its own generators: `seed` on rank 0 (a single process is unchanged), a
        hash of (seed, rank) elsewhere, so no two ranks draw the same stream."""
        if self.rank == 0:
            return seed
        digest = hashlib.sha256(f"equiconvert/{seed}/{self.rank}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The element-wise sums over all ranks of `tensors` (one all-reduce of one flat buffer)."""
        if not self.enabled:
            return list(tensors)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (small, picklable objects: generator states)."""
        if not self.enabled:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def all_gather_rows(self, rows: torch.Tensor, total: int) -> torch.Tensor:
        """Concatenate, in rank order, each rank's rows (its `row_slice(total)` of a set of `total` rows)."""
        if not self.enabled:
            return rows
        width = -(-total // self.world_size)
        padded = rows.new_zeros((width, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        lengths = [
            self.row_slice(total, rank).stop - self.row_slice(total, rank).start for rank in range(self.world_size)
        ]
        return torch.cat([part[:length] for part, length in zip(parts, lengths)])

    def row_slice(self, total: int, rank: int | None = None) -> slice:
        """The contiguous slice of `total` rows that `rank` (default: this one) evaluates; none is empty."""
        if total < self.world_size:
            raise ParameterError(
                f"total={total} rows cannot be shared by {self.world_size} ranks; give at least one each"
            )
        rank = self.rank if rank is None else rank
        return slice(rank * total // self.world_size, (rank + 1) * total // self.world_size)

    def broadcast_module(self, module: nn.Module) -> None:
        """Copy rank 0's parameters and buffers to every rank (all start from the same weights)."""
        if not self.enabled:
            return
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.data, src=0)

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block before the others (it fills the data cache they then read)."""
        if self.enabled and not self.is_main:
            dist.barrier()
        yield
        if self.enabled and self.is_main:
            dist.barrier()

    def max_on_host(self, value: int) -> int:
        """The largest of every rank's `value`, exchanged between the hosts: no wait for the device."""
        if not self.enabled:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.host_group)
        return int(tensor.item())

    def agree(self, flag: bool, device: torch.device) -> bool:
        """Rank 0's `flag` on every rank (a stop decision that all ranks must take together)."""
        if not self.enabled:
            return flag
        value = torch.tensor([int(flag)], device=device)
        dist.broadcast(value, src=0)
        return bool(value.item())


SINGLE_PROCESS = DistributedContext()


def launched_world_size() -> int:
    """The WORLD_SIZE torchrun set for this process (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def from_environment(device: str | None) -> tuple[DistributedContext, str | None]:
    """Join the process group torchrun describes (if WORLD_SIZE > 1) and pick this rank's device.

    "cuda" (or no device, with CUDA present) becomes cuda:LOCAL_RANK; the backend follows the device type. A worker
    is killed when its launcher dies (worker_lifetime.py).
    """
    world_size = launched_world_size()
    if world_size == 1:
        return SINGLE_PROCESS, device
    die_with_parent()  # a launcher killed with SIGKILL takes its workers with it
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank}"
    elif device.startswith("cuda:"):
        raise ParameterError(
            f"device={device}: in a job of {world_size} processes give device=cuda, and each rank "
            "takes cuda:LOCAL_RANK (choose the cards with CUDA_VISIBLE_DEVICES)"
        )
    kind = torch.device(device).type
    if kind not in BACKENDS:
        raise ParameterError(f"device={device}: distributed training runs on {sorted(BACKENDS)} devices")
    if kind == "cuda":
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        dist.init_process_group(BACKENDS[kind], device_id=torch.device(device) if kind == "cuda" else None)
    host_group = dist.new_group(backend=BACKENDS["cpu"]) if BACKENDS[kind] != BACKENDS["cpu"] else None
    return DistributedContext(world_size, rank, local_rank, host_group), device


def shutdown() -> None:
    """Leave the process group (after the last collective of a run)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class WorkerLostError(RunError):
    """A collective failed because another worker of the job is gone (gloo's "Connection closed by peer")."""


def lost_worker(error: RuntimeError) -> WorkerLostError | None:
    """The one-line error for gloo's failure of a collective (its C++ location dropped), or None for another one."""
    text = str(error)
    if "/gloo/" not in text:
        return None
    detail = text.split("] ", 1)[-1].split(". ")[0]
    return WorkerLostError(f"another worker of this job stopped ({detail}); the launcher's last line names it")


def launch(nproc_per_node: int, module: str, argv: Sequence[str], log_dir: Path) -> None:
    """Run `python -m module argv...` on `nproc_per_node` local workers through torchrun's own entry point.

    Workers other than rank 0 write their stderr under `log_dir` (worker_log finds it); rank 0 keeps the console
    (its progress bar and errors). Raises torch's ChildFailedError if a worker fails, and its SignalException when
    this process gets SIGINT or SIGTERM: torchrun has then passed the signal to the workers (which finish their
    step and write a checkpoint) and waited up to STOP_GRACE_S for them.
    """
    from torch.distributed.run import parse_args, run

    redirects = ["--redirects", ",".join(f"{rank}:2" for rank in range(1, nproc_per_node))]
    options = [
        "--log-dir",
        str(log_dir),
        "--shutdown-timeout",
        str(STOP_GRACE_S),
        *(redirects if nproc_per_node > 1 else []),
    ]

    added = launcher_environment()  # the workers copy this process's environment when they start
    os.environ.update(added)
    try:
        run(parse_args(["--standalone", "--nproc-per-node", str(nproc_per_node), *options, "--module", module, *argv]))
    finally:
        for name in added:
            os.environ.pop(name, None)


def worker_log(log_dir: Path, rank: int) -> Path | None:
    """The stderr file torchrun wrote for local worker `rank` of the last attempt under `log_dir` (None for rank 0,
    which writes to the console)."""
    logs = sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"), key=lambda path: path.stat().st_mtime)
    return logs[-1] if logs else None
