"""Poisson subsampling of logical batches, as the DP-SGD privacy analysis assumes.

The RDP/PRV accountants bound the privacy loss of the *subsampled Gaussian
mechanism*: every example joins every step independently with probability q.
Shuffling into fixed-size batches is a different mechanism whose guarantee the
accountant does not certify, so logical batches here have random size (possibly
zero) and are only later cut into fixed-size physical chunks to fit in memory.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ParameterError
from .secure_rng import RandomSource


class PoissonSampler:
    """Draws logical batches by independent Bernoulli(q) inclusion of each example.

    Its randomness is a `RandomSource` of its own (secret by default, see
    secure_rng), so the batch sequence depends on nothing else, and
    `state_dict()` lets a resumed run draw exactly the batches it would have.

    shard (rank, world_size): in data-parallel training (training/distributed.py) each rank draws only the indices
    rank, rank + world_size, ..., still at the global rate q, so that across the ranks every example joins a
    batch independently with probability q exactly once.
    """

    def __init__(
        self, num_examples: int, expected_batch_size: int, source: RandomSource, shard: tuple[int, int] = (0, 1)
    ) -> None:
        if num_examples <= 0:
            raise ParameterError(f"num_examples must be positive, got {num_examples}")
        if expected_batch_size <= 0 or expected_batch_size > num_examples:
            raise ParameterError(
                f"sample rate q = expected_batch_size / num_examples = {expected_batch_size}/{num_examples} "
                "must satisfy 0 < q <= 1"
            )
        self.num_examples = int(num_examples)
        self.expected_batch_size = int(expected_batch_size)
        self.sample_rate = self.expected_batch_size / self.num_examples
        rank, world_size = shard
        if not 0 <= rank < world_size:
            raise ParameterError(f"shard (rank, world_size) needs 0 <= rank < world_size, got {shard}")
        self.shard = (int(rank), int(world_size))
        self._members = torch.arange(rank, self.num_examples, world_size)
        self.num_batches_drawn = 0
        self._source = source

    def sample(self) -> torch.Tensor:
        """Indices (int64, ascending, no duplicates) of one logical batch; may be empty."""
        mask = self._source.bernoulli_mask(len(self._members), self.sample_rate)
        self.num_batches_drawn += 1
        return self._members[mask.cpu()]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the exact batch sequence after a restart (secret: see secure_rng)."""
        return {
            "num_examples": self.num_examples,
            "expected_batch_size": self.expected_batch_size,
            "shard": self.shard,
            "num_batches_drawn": self.num_batches_drawn,
            "generator_states": self._source.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`; refuses one for a different data set size or q (the accounting would lie)."""
        if (state["num_examples"], state["expected_batch_size"]) != (self.num_examples, self.expected_batch_size):
            raise ParameterError(
                f"state: sampler state is for {state['expected_batch_size']}/{state['num_examples']}, "
                f"this sampler is {self.expected_batch_size}/{self.num_examples}"
            )
        if tuple(state.get("shard", (0, 1))) != self.shard:
            raise ParameterError(
                f"state: sampler state is for shard (rank, world_size) {tuple(state['shard'])}, "
                f"this sampler samples shard {self.shard}"
            )
        self.num_batches_drawn = int(state["num_batches_drawn"])
        self._source.load_state_dict(state["generator_states"])


def physical_chunks(indices: torch.Tensor, max_physical_batch: int) -> list[torch.Tensor]:
    """Split a logical batch into consecutive chunks of at most `max_physical_batch` (memory bound only).

    Chunking does not change the DP-SGD step: per-sample gradients are clipped
    and summed over all chunks before noise is added once per logical batch.
    """
    if max_physical_batch <= 0:
        raise ParameterError(f"max_physical_batch must be positive, got {max_physical_batch}")
    if indices.dim() != 1:
        raise ParameterError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
    if indices.numel() == 0:
        return []
    return list(torch.split(indices, max_physical_batch))
