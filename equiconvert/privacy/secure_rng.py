"""Secret randomness of DP-SGD: the Gaussian noise and the Poisson sampling.

The guarantee holds only if nobody can recompute the noise or the batches: anyone
who can subtract the noise from a released update recovers the sum of clipped
gradients. Each purpose therefore owns two torch generators seeded from the
operating system's CSPRNG (`secrets`, 64 bits each, 128 secret bits together;
a torch generator takes a 64-bit seed). The seeds are never stored; only the
generators' states, in checkpoints, which are as secret as the training data.

- Noise: (z1 + z2) / sqrt(2) with z1, z2 ~ N(0, std^2) from the two generators.
  Besides combining both seeds, the sum of two samples is Opacus' secure_mode
  defence against floating-point attacks on the Gaussian sampler (Mironov 2012;
  Holohan and Braghin 2021): it fills the gaps in the set of representable
  outputs that those attacks read off a single sample.
- Sampling: u = frac(u1 + u2) with u1, u2 ~ U[0, 1) from the two generators is
  uniform on [0, 1) if either is; example i joins the batch when u_i < q.

`seeded_from(seed, purpose)` derives both seeds from a public seed instead: a
reproducible mode for tests and debugging that is NOT private (the noise can
then be rebuilt and removed).
"""

from __future__ import annotations

import hashlib
import math
import secrets

import torch

_STREAMS = 2  # generators per purpose: 2 x 64 seed bits
NOISE, SAMPLING = "noise", "sampling"


class RandomSource:
    """Two independently seeded torch generators on one device, combined for one purpose."""

    def __init__(self, seeds: tuple[int, ...], device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self._generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]

    @classmethod
    def secret(cls, device: str | torch.device = "cpu") -> "RandomSource":
        """Seeded from the OS CSPRNG; the seeds are dropped once the generators hold them."""
        return cls(tuple(secrets.randbits(64) for _ in range(_STREAMS)), device)

    @classmethod
    def seeded_from(cls, seed: int, purpose: str, device: str | torch.device = "cpu") -> "RandomSource":
        """Seeded from a public seed (NOT private): the reproducible mode."""
        return cls(tuple(_derived_seed(seed, purpose, k) for k in range(_STREAMS)), device)

    def gaussian(self, shape: torch.Size | tuple[int, ...], std: float) -> torch.Tensor:
        """N(0, std^2) samples: the normalised sum of one sample from each generator."""
        first, second = (
            torch.normal(0.0, std, tuple(shape), generator=g, device=self.device) for g in self._generators
        )
        return (first + second) / math.sqrt(_STREAMS)

    def uniform(self, n: int) -> torch.Tensor:
        """n samples of U[0, 1): the fractional part of the sum of one sample from each generator."""
        total = sum(torch.rand(n, generator=g, device=self.device, dtype=torch.float64) for g in self._generators)
        return torch.frac(total)

    def state_dict(self) -> list[torch.Tensor]:
        """The generators' states (uint8 tensors: loadable with torch.load(weights_only=True))."""
        return [g.get_state() for g in self._generators]

    def load_state_dict(self, states: list[torch.Tensor]) -> None:
        if not isinstance(states, (list, tuple)) or len(states) != _STREAMS:
            raise ValueError(f"a random source state is a list of {_STREAMS} generator states")
        for generator, state in zip(self._generators, states):
            generator.set_state(state.to(device="cpu", dtype=torch.uint8))


def make_source(purpose: str, insecure_seed: int | None, device: str | torch.device = "cpu") -> RandomSource:
    """The source for `purpose`: secret unless a seed is given for the (non-private) reproducible mode."""
    if insecure_seed is None:
        return RandomSource.secret(device)
    return RandomSource.seeded_from(insecure_seed, purpose, device)


def _derived_seed(seed: int, purpose: str, stream: int) -> int:
    digest = hashlib.sha256(f"equiconvert:{purpose}:{stream}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little")
