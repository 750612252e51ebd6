"""What a torch CPU generator's state gives away: its seed, and whether it has drawn since it was seeded or keyed."""

from __future__ import annotations

import torch

_MT_WORDS = slice(24, 24 + 8 * 624)  # MT19937's state words in a CPU generator's state (secure_rng.key_generator)


def initial_seed(state: torch.Tensor) -> int:
    """The seed a torch CPU generator's state starts with (its first 8 bytes; 0 for a keyed one)."""
    return int.from_bytes(bytes(state[:8].tolist()), "little")


def freshly_keyed(state: torch.Tensor) -> bool:
    """Whether `state` is that of a generator that has drawn nothing since it was seeded or keyed: every field but
    its seed and its 624 words is as a fresh generator's (the next draw regenerates all the words, no normal
    sample is cached), so the state is its seed's or its key's alone and derives no earlier draw."""
    fresh = torch.Generator().manual_seed(initial_seed(state)).get_state()
    position = torch.ones(state.numel(), dtype=torch.bool)
    position[_MT_WORDS] = False
    return state.numel() == fresh.numel() and torch.equal(state[position], fresh[position])
