"""Secret randomness for DP-SGD: which examples a step samples and which noise it adds.

The privacy analysis assumes an adversary knows neither. Each stream here is two
torch generators seeded independently from the OS CSPRNG (`secrets`), combined so
that either one alone being secret keeps the draws secret: Bernoulli masks from the
XOR of two uniform integers, Gaussian noise as (z1 + z2) / sqrt(2). The seeds are
never stored, printed or checkpointed. `debug_seed` derives both seeds from one
integer instead, for reproducible tests; such a run is not private and says so.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import warnings

import torch

_BITS = 53  # uniform integers in [0, 2**53): exact in float64, so q * 2**53 rounds once
DEBUG_SEED_WARNING = (
    "debug_seed is set: Poisson sampling and noise are reproducible from it, so this run is NOT "
    "differentially private; use it for tests only"
)


def _seeds(debug_seed: int | None, stream: str) -> tuple[int, int]:
    if debug_seed is None:
        return secrets.randbits(64), secrets.randbits(64)
    digests = (hashlib.sha256(f"{debug_seed}/{stream}/{i}".encode()).digest() for i in range(2))
    return tuple(int.from_bytes(d[:8], "little") for d in digests)  # type: ignore[return-value]


class SecretGenerators:
    """Two independently seeded torch generators on `device` whose draws are always combined."""

    def __init__(self, device: torch.device | str, stream: str, debug_seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.private = debug_seed is None
        self._generators = [
            torch.Generator(device=self.device).manual_seed(seed) for seed in _seeds(debug_seed, stream)
        ]

    def normal(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal draws: (z1 + z2) / sqrt(2) with z1, z2 from the two generators."""
        z1, z2 = (torch.randn(shape, generator=g, device=self.device, dtype=dtype) for g in self._generators)
        return (z1 + z2) / math.sqrt(2.0)

    def bernoulli_mask(self, size: int, probability: float) -> torch.Tensor:
        """A bool mask of `size` independent Bernoulli(probability) draws (P = ceil(p * 2**53) / 2**53)."""
        r1, r2 = (
            torch.randint(0, 2**_BITS, (size,), generator=g, device=self.device, dtype=torch.int64)
            for g in self._generators
        )
        return torch.bitwise_xor(r1, r2) < math.ceil(probability * 2**_BITS)


def warn_if_debug_seeded(debug_seed: int | None) -> None:
    """The Python warning every debug-seeded run gives."""
    if debug_seed is not None:
        warnings.warn(DEBUG_SEED_WARNING, stacklevel=3)
