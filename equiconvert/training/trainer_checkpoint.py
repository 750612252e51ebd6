"""DPTrainer's checkpoint: everything a stopped run needs to continue as if it had never stopped.

The file (privacy/checkpoint.py writes it atomically and owner-only) holds the model, optimizer, EMA, ledger, the
log's length and wall time, and the generators of every rank; a run resumes it only with the same
configuration and number of processes, so the resumed steps draw the same samples and noise the run that
wrote it did. In the private mode the generators are re-keyed at each save (secure_rng): the checkpoint
reproduces the steps after it up to the next save, never one before it, and a resumed run is identical in
distribution to an uninterrupted one; in the seeded mode it is identical bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import MissingFileError, ParameterError
from ..privacy.accounting import PrivacyLedger
from ..privacy.checkpoint import CheckpointError, load, save_atomic
from ..privacy.sampling import PoissonSampler
from ..privacy.secure_rng import RandomSource, rekey_generators, rekey_global_generators
from .distributed import DistributedContext
from .dp_config import DPConfig
from .ema import ExponentialMovingAverage
from .run_folder import CHECKPOINT
from .run_log import RunClock, RunLog

METHOD_ONLY_OPTIONS = (
    "per_sample_method",
    "data_in_memory_bytes",
    "physical_batch_multiple",
    "cudnn_benchmark",
    "cuda_graph",
)  # how gradients are computed, not what they are
EVALUATION_ONLY_OPTIONS = ("test_shifts",)  # what evaluations also report, not what is trained
RECORD_ONLY_OPTIONS = ("checkpoint_every", "log_step_times")  # what is written along the way, not what is trained


class TrainerCheckpoint:
    """save_checkpoint and resume for DPTrainer (a mixin: the attributes below are the trainer's)."""

    config: DPConfig
    dist: DistributedContext
    out_dir: Path | None
    step: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    ema: ExponentialMovingAverage | None
    ledger: PrivacyLedger | None
    sampler: PoissonSampler | None
    noise_multiplier: float | None
    _nonfinite: torch.Tensor
    _augment_rng: torch.Generator
    _noise_source: RandomSource
    _log: RunLog
    _clock: RunClock
    _checkpoint_step: int | None
    private: bool

    def checkpoint_path(self) -> Path:
        """Where save_checkpoint writes and resume reads: the run folder's checkpoint file."""
        if self.out_dir is None:
            raise ParameterError("checkpoints need out_dir")
        return self.out_dir / CHECKPOINT

    def save_checkpoint(self) -> None:
        """Rank 0 writes the job's state: the shared one once, each rank's own generators (all ranks call this)."""
        self._verify_buffers()  # no buffer a private batch changed is ever written
        self._log.flush()
        ranks = self.dist.all_gather_object(self._rank_state())  # [distributed]
        self._checkpoint_step = self.step
        if not self.dist.is_main:
            return
        state = {
            "step": self.step,
            "config": asdict(self.config),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "ledger": self.ledger.state_dict(),
            "noise_multiplier": self.noise_multiplier,
            "nonfinite_gradients": int(self._nonfinite),
            "world_size": self.dist.world_size,
            "log_lines": self._log.lines,
            "elapsed_s": self._clock.elapsed(),
            **ranks[0],
            "other_ranks": ranks[1:],
        }
        save_atomic(state, self.checkpoint_path())

    def _rank_state(self) -> dict[str, Any]:
        """What differs between the ranks of a job: the sampler of its shard and its generators.

        Private mode: every generator is re-keyed first (the sources re-key in their state_dict), since the
        augmentation's and the global ones' positions count the examples drawn, i.e. the secret batch sizes.
        """
        if self.private:
            rekey_generators(self._augment_rng)
            rekey_global_generators()
        return {
            "sampler": self.sampler.state_dict(),
            "rng": {
                "augment": self._augment_rng.get_state(),
                "noise": self._noise_source.state_dict(),
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
        }

    def _resume(self) -> None:
        """Load the checkpoint in out_dir into this trainer, refusing one of another job or configuration."""
        path = self.checkpoint_path()
        found = self.dist.all_gather_object(path.exists())  # [distributed] every rank reads rank 0's file
        if not any(found):
            raise CheckpointError(f"nothing to resume: no checkpoint at {path}; start without resuming")
        if not all(found):
            raise MissingFileError(
                f"{path} exists on ranks {[r for r, f in enumerate(found) if f]} only: a job "
                "resumes from one checkpoint, so out= must be on a file system every node sees"
            )
        state = load(path)
        saved_world_size = state.get("world_size", 1)
        if saved_world_size != self.dist.world_size:
            raise CheckpointError(
                f"checkpoint {path} was written by a job of {saved_world_size} process(es); this job "
                f"has {self.dist.world_size}: resume it with {saved_world_size} (each rank continues "
                "its own shard's sampler), or give another out="
            )
        saved, current = resume_identity(state["config"]), resume_identity(asdict(self.config))
        if saved != current:
            differing = {
                key: (saved.get(key), current.get(key)) for key in current if saved.get(key) != current.get(key)
            }
            raise ParameterError(
                f"checkpoint {path} was written with a different configuration ((checkpoint, now): "
                f"{differing}); refusing to resume"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        self.ledger.load_state_dict(state["ledger"])
        own = state if self.dist.is_main else state["other_ranks"][self.dist.rank - 1]
        self.sampler.load_state_dict(own["sampler"])
        self.noise_multiplier = state["noise_multiplier"]
        self._nonfinite.fill_(int(state.get("nonfinite_gradients", 0)))
        self._augment_rng.set_state(own["rng"]["augment"])
        self._noise_source.load_state_dict(own["rng"]["noise"])
        torch.set_rng_state(own["rng"]["torch"])
        if own["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(own["rng"]["cuda"])
        self.step = self._checkpoint_step = state["step"]
        self._log.resume(state.get("log_lines"))
        self._clock.before = float(state.get("elapsed_s", 0.0))


def resume_identity(config: dict[str, Any]) -> dict[str, Any]:
    """The options a resumed run must share with its checkpoint.

    An option missing from the checkpoint takes its DPConfig default (e.g. precision "fp32").
    """
    known = {f.name for f in fields(DPConfig)}
    as_read = asdict(DPConfig(**{**asdict(DPConfig()), **{k: v for k, v in config.items() if k in known}}))
    full = {**config, **as_read}  # DPConfig's reading of its own options (0 as off: None), other keys as stored
    return {
        key: value
        for key, value in full.items()
        if key not in METHOD_ONLY_OPTIONS + EVALUATION_ONLY_OPTIONS + RECORD_ONLY_OPTIONS
    }
