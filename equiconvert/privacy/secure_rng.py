"""Secret randomness of DP-SGD: the Gaussian noise and the Poisson sampling.

The guarantee holds only if nobody can recompute the noise or the batches: anyone
who can subtract the noise from a released update recovers the sum of clipped
gradients. Each purpose therefore owns two torch generators keyed from the
operating system's CSPRNG (`secrets`), and every draw combines one draw of each,
so the result stays secret while either key is. The keys are never stored.
A CPU generator (MT19937) keeps only the low 32 bits of a seed, so a secret one is
not seeded: its whole 624-word state is filled from a 128-bit key by SHAKE-256, so
each CPU generator holds 128 secret bits (256 a purpose). A CUDA generator (Philox)
takes its 64-bit seed whole: 64 bits each, 128 a purpose.

Forward security: a torch generator's state holds its seed (and MT19937 runs backwards), so a state written
after some draws would let its holder replay them. `state_dict()` of a secret source therefore re-keys it
first with fresh CSPRNG keys: the states it returns (what checkpoints hold) derive the draws after it and
nothing before, and the live run goes on from exactly those states, so a resumed run draws what the
run that wrote the checkpoint does, up to the next save (each save re-keys afresh). `rekey_generators` does the same for the generators whose position counts the
secret batch sizes (augmentation, and torch's global ones that dropout draws from).

- Noise: (z1 + z2) / sqrt(2) with z1, z2 ~ N(0, std^2) from the two generators,
  drawn in at least float32. Besides combining both keys, the sum of two samples
  is Opacus' secure_mode defence against floating-point attacks on the Gaussian
  sampler (Mironov 2012; Holohan and Braghin 2021): it fills the gaps in the set of
  representable outputs that those attacks read off a single sample.
- Sampling: r = r1 XOR r2 with r1, r2 uniform integers in [0, 2^53) from the two
  generators; XOR with an independent uniform integer is a bijection, so r is
  exactly uniform if either is, on every device (a sum of two floats rounds).
  Example i joins the batch when r_i < floor(q * 2^53): probability within 2^-53
  of q and never above it, so the accountant's q bounds the true rate.

The reproducible mode, `make_source(purpose, seed)` or `RandomSource.seeded_from`,
derives both seeds from a public seed instead: for tests and debugging, NOT private
(the noise can then be rebuilt and removed). Its entry points are make_private's
`debug_seed` and `DPConfig.insecure_seeded_noise`; both warn with `warn_not_private`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import secrets
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ParameterError, ParameterTypeError, PrivacyError

_STREAMS = 2  # generators per purpose, each keyed on its own
_KEY_BYTES = 16  # a secret generator's key: 128 bits
_MT_WORDS, _MT_OFFSET = 624, 24  # MT19937's state words, as uint64 from byte 24 of a CPU generator's state
_BITS = 53  # sampling integers in [0, 2**53): q * 2**53 is exact in float64
NOISE, SAMPLING = "noise", "sampling"
NOT_PRIVATE_WARNING = (
    "{option}: the DP-SGD noise and Poisson sampling are seeded from a public seed, so this run is NOT "
    "differentially private (anyone with the seed can rebuild the noise and subtract it); use it for tests "
    "and debugging only"
)


class RandomSource:
    """Two torch generators on one device, each keyed (secret) or seeded (reproducible mode) on its own, combined
    for one purpose.

    `private` says whether the keys are secret: True only for `secret()`.
    """

    def __init__(self, seeds: Sequence[int], device: str | torch.device = "cpu", *, private: bool = False) -> None:
        if len(seeds) != _STREAMS:
            raise ParameterError(f"seeds: a random source takes {_STREAMS} seeds, got {len(seeds)}")
        self.device = torch.device(device)
        self.private = private
        self._generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]

    @classmethod
    def secret(cls, device: str | torch.device = "cpu") -> RandomSource:
        """Keyed from the OS CSPRNG (rekey_generators); the keys are dropped once the generators hold them."""
        source = cls([0] * _STREAMS, device, private=True)
        source.rekey()
        return source

    @classmethod
    def seeded_from(cls, seed: int, purpose: str, device: str | torch.device = "cpu") -> RandomSource:
        """Seeded from a public seed (NOT private): the reproducible mode."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ParameterTypeError(
                f"the reproducible mode's seed (make_private's debug_seed, DPConfig.seed) must be an int, got {seed!r}"
            )
        return cls([_derived_seed(seed, purpose, k) for k in range(_STREAMS)], device)

    def gaussian(
        self, shape: torch.Size | tuple[int, ...], std: float, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """N(0, std^2) samples of `dtype`: the normalised sum of one sample from each generator."""
        draw_dtype = torch.promote_types(dtype, torch.float32)
        first, second = (
            torch.randn(tuple(shape), generator=g, device=self.device, dtype=draw_dtype) for g in self._generators
        )
        return ((first + second) * (std / math.sqrt(_STREAMS))).to(dtype)

    def bernoulli_mask(self, size: int, probability: float) -> torch.Tensor:
        """A bool mask of `size` independent Bernoulli draws of P = floor(probability * 2^53) / 2^53."""
        if not 0.0 <= probability <= 1.0:
            raise ParameterError(f"probability: a sampling probability lies in [0, 1], got {probability}")
        first, second = (
            torch.randint(0, 2**_BITS, (size,), generator=g, device=self.device, dtype=torch.int64)
            for g in self._generators
        )
        return torch.bitwise_xor(first, second) < math.floor(probability * 2**_BITS)

    def rekey(self) -> None:
        """A secret source takes fresh CSPRNG seeds for every draw from now on; a seeded one keeps its stream."""
        if self.private:
            rekey_generators(*self._generators)

    def state_dict(self) -> list[torch.Tensor]:
        """The generators' states (uint8 tensors: loadable with torch.load(weights_only=True)), forward-secure:
        a secret source re-keys first, so they derive no draw made before this call."""
        self.rekey()
        return [g.get_state() for g in self._generators]

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickling and copying go through `state_dict()`: a saved optimizer or loader replays no earlier draw."""
        return (_restored, (str(self.device), self.private, self.state_dict()))

    def load_state_dict(self, states: list[torch.Tensor]) -> None:
        if not isinstance(states, (list, tuple)) or len(states) != _STREAMS:
            raise ParameterError(f"states: a random source state is a list of {_STREAMS} generator states")
        for generator, state in zip(self._generators, states):
            generator.set_state(state.to(device="cpu", dtype=torch.uint8))


def _restored(device: str, private: bool, states: list[torch.Tensor]) -> RandomSource:
    source = RandomSource([0] * _STREAMS, device, private=private)
    source.load_state_dict(states)
    return source


def rekey_generators(*generators: torch.Generator) -> None:
    """Fresh 128-bit CSPRNG keys for `generators` (key_generator): their states then derive only the draws after
    this call."""
    for generator in generators:
        key_generator(generator, secrets.token_bytes(_KEY_BYTES))


def key_generator(generator: torch.Generator, key: bytes) -> None:
    """Make `generator`'s state a function of all of `key`: on the CPU, MT19937's 624 words from SHAKE-256 of the
    key (manual_seed would keep 32 bits of it); elsewhere (Philox) the 64-bit seed the key derives."""
    stream = hashlib.shake_256(b"equiconvert:generator-key:" + key)
    if generator.device.type != "cpu":
        generator.manual_seed(int.from_bytes(stream.digest(8), "little"))
        return
    _check_mt_layout()
    generator.manual_seed(0)  # resets the cached normal samples; its seed is then overwritten
    state = generator.get_state().clone()
    words = torch.frombuffer(bytearray(stream.digest(4 * _MT_WORDS)), dtype=torch.int32).view(torch.uint8)
    widened = torch.zeros((_MT_WORDS, 8), dtype=torch.uint8)
    widened[:, :4] = words.reshape(_MT_WORDS, 4)  # little-endian uint32 words, zero-extended to uint64
    state[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS] = widened.reshape(-1)
    generator.set_state(state)


@functools.cache
def _check_mt_layout() -> None:
    """key_generator writes MT19937's words where this torch keeps them: checked once against a known seed."""
    seed, expected = 1, [1]
    for index in (1, 2):  # MT19937's initialisation of its first words from a seed
        expected.append((1812433253 * (expected[-1] ^ (expected[-1] >> 30)) + index) % 2**32)
    state = torch.Generator().manual_seed(seed).get_state()
    words = state[_MT_OFFSET : _MT_OFFSET + 24].view(torch.int64).tolist()
    if words != expected or state.numel() < _MT_OFFSET + 8 * _MT_WORDS:
        raise PrivacyError(
            f"secret randomness: torch {torch.__version__} lays out its CPU generator state in a way equiconvert "
            "does not know, so it cannot key it with 128 bits; please report this with your torch version"
        )


def rekey_global_generators() -> None:
    """Fresh CSPRNG seeds for torch's global generators of every device (what dropout draws from)."""
    torch.manual_seed(secrets.randbits(64))


def make_source(purpose: str, insecure_seed: int | None, device: str | torch.device = "cpu") -> RandomSource:
    """The source for `purpose`: secret unless a seed is given for the (non-private) reproducible mode."""
    if insecure_seed is None:
        return RandomSource.secret(device)
    return RandomSource.seeded_from(insecure_seed, purpose, device)


def warn_not_private(option: str, stacklevel: int = 3) -> None:
    """The warning every run in the reproducible mode gives once; `option` names the flag that chose it."""
    warnings.warn(NOT_PRIVATE_WARNING.format(option=option), stacklevel=stacklevel)


def _derived_seed(seed: int, purpose: str, stream: int) -> int:
    digest = hashlib.sha256(f"equiconvert:{purpose}:{stream}:{seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little")
