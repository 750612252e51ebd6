"""What a torch CPU generator's state gives away: its seed, and whether it has drawn since it was seeded."""

from __future__ import annotations

import torch


def initial_seed(state: torch.Tensor) -> int:
    """The seed a torch CPU generator's state starts with (its first 8 bytes)."""
    return int.from_bytes(bytes(state[:8].tolist()), "little")


def freshly_keyed(state: torch.Tensor) -> bool:
    """Whether `state` is that of a generator that has drawn nothing since it was seeded: running MT19937
    backwards from it leads to its seed and no further, so it derives no earlier draw."""
    return torch.equal(state, torch.Generator().manual_seed(initial_seed(state)).get_state())
