"""The options of a DP-SGD run: DPConfig (each option's one default), the values allowed, and their check.

check_config runs before any data is loaded, so an option that cannot train fails at once, naming its field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .augment import shift_set
from .filter_gradients import FILTER_GRADIENT_METHODS
from .normalization import check_normalization

CUSTOM = "custom"  # a callable given to DPTrainer (optimizer factory, lr schedule)
OPTIMIZERS = ("sgd", "nadam", CUSTOM)
PER_SAMPLE_METHODS = ("auto", "bookkeeping", "vmap")
CUSTOM_SCHEDULE = CUSTOM  # a callable step -> lr given to DPTrainer
LR_SCHEDULES = ("constant", "cosine", CUSTOM_SCHEDULE)
# forward/backward dtype under autocast (None: the model's own); per-sample gradients, clipping and noise stay fp32
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


@dataclass
class DPConfig:
    """Hyper-parameters of a DP-SGD run (the defaults follow Hölzl et al.'s CIFAR-10 setting)."""

    target_epsilon: float | None = 8.0
    delta: float | None = None  # None: accounting.default_delta(number of training examples)
    batch_size: int = 8192  # expected logical batch size
    steps: int = 2200
    aug_mult: int = 4
    max_grad_norm: float = 2.0
    lr: float = 2.0
    momentum: float = 0.0
    optimizer: str = "sgd"
    lr_schedule: str = "constant"  # "cosine": lr * (1 + cos(pi * step / steps)) / 2; "custom": a callable
    ema_decay: float | None = 0.999
    accountant: str = "rdp"
    noise_multiplier: float | None = None  # None: calibrated from target_epsilon
    physical_batch_size: int = 256
    augment_padding: int = 4
    augment_flip: bool = True
    normalize_mean: float | tuple[float, ...] = 0.5  # one value, or one per channel
    normalize_std: float | tuple[float, ...] = 0.5
    # a Dataset (or DataLoader) whose images take at most this many bytes is read once into tensors on the
    # device; a larger one is streamed (each step reads its sampled examples through the Dataset)
    data_in_memory_bytes: int = 2**30
    seed: int = 0  # initial weights (set by the caller), augmentation and data order; never the noise or sampling
    # NOT private: seed the noise and the Poisson sampling from `seed` (tests, debugging); the default draws them from
    # the operating system's CSPRNG (secure_rng), and anyone with the seed could subtract the noise
    insecure_seeded_noise: bool = False
    eval_every: int | None = None
    eval_batch_size: int = 1024
    checkpoint_every: int | None = None
    # NOT private: log each step's noise-free mean training loss and actual Poisson batch size (and count of
    # non-finite per-example gradients), statistics of the private data released without noise
    log_nonprivate_stats: bool = False
    epsilon_every: int = 10  # log epsilon every this many steps (PRV's get_epsilon is slow)
    # "bookkeeping": fastest and leanest measured (benchmarks/throughput.py, H200); "vmap": torch.func, for any
    # model; "auto": bookkeeping unless the model fails its checks (static, then a probe at the first step), then vmap
    per_sample_method: str = "auto"
    # "bf16": the forward and backward of the per-sample computation under bf16 autocast (book-keeping only;
    # tensor-core speed); each example's gradient is formed, clipped and noised in fp32, so the privacy bound holds
    precision: str = "fp32"
    # book-keeping's per-example conv filter gradients (filter_gradients.py): "auto" times every kernel per layer on
    # CUDA and keeps the fastest, and uses the grouped weight gradient on CPU; "products", "grouped" or "unfolded"
    # fixes it
    filter_gradients: str = "auto"
    # a name in augment.TEST_SHIFTS: every evaluation also reports "shift_averaged_*" metrics, the softmax averaged
    # over those shifted copies of each test image (post-processing: no privacy cost); the plain metrics are kept
    test_shifts: str | None = None


def check_config(c: DPConfig) -> None:
    """Refuse options that cannot train (before any data is loaded); errors name the DPConfig field."""
    if c.optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {c.optimizer!r}")
    if c.filter_gradients not in FILTER_GRADIENT_METHODS:
        raise ValueError(f"filter_gradients must be one of {FILTER_GRADIENT_METHODS}, got {c.filter_gradients!r}")
    if c.test_shifts is not None:
        shift_set(c.test_shifts)
    if c.per_sample_method not in PER_SAMPLE_METHODS:
        raise ValueError(f"per_sample_method must be one of {PER_SAMPLE_METHODS}, got {c.per_sample_method!r}")
    if c.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {c.precision!r}")
    if c.precision != "fp32" and c.per_sample_method == "vmap":
        raise ValueError(
            f"precision {c.precision!r} needs book-keeping per-sample gradients "
            "(per_sample_method 'bookkeeping' or 'auto'); vmap runs in fp32 only"
        )
    if c.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {c.lr_schedule!r}")
    if c.target_epsilon is None and c.noise_multiplier is None:
        raise ValueError("give target_epsilon (sigma is calibrated) or noise_multiplier")
    if c.noise_multiplier is not None and c.noise_multiplier <= 0:
        raise ValueError(f"noise_multiplier must be > 0 for a private run, got {c.noise_multiplier}")
    if c.aug_mult < 1 or c.batch_size < 1 or c.steps < 0 or c.max_grad_norm <= 0:
        raise ValueError("aug_mult and batch_size must be >= 1, steps >= 0, max_grad_norm > 0")
    if c.physical_batch_size < 1 or c.eval_batch_size < 1 or c.epsilon_every < 1:
        raise ValueError("physical_batch_size, eval_batch_size and epsilon_every must be >= 1")
    if c.target_epsilon is not None and not c.target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {c.target_epsilon}")
    if c.delta is not None and not 0 < c.delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {c.delta}")
    if c.ema_decay is not None and not 0 < c.ema_decay < 1:
        raise ValueError(f"ema_decay must lie in (0, 1) (None: no EMA), got {c.ema_decay}")
    if not c.lr > 0:
        raise ValueError(f"lr must be > 0, got {c.lr}")
    check_normalization(c.normalize_mean, c.normalize_std)
    if c.data_in_memory_bytes < 0:
        raise ValueError(
            f"data_in_memory_bytes must be >= 0 (0: always stream a Dataset), got {c.data_in_memory_bytes}"
        )
    if c.augment_padding < 0:
        raise ValueError(f"augment_padding (crop shift in pixels) must be >= 0, got {c.augment_padding}")


def named_schedule(config: DPConfig) -> Callable[[int], float] | None:
    """The learning rate of step t (0-based) for config.lr_schedule; None keeps the optimizer's lr."""
    if config.lr_schedule == "cosine":
        return lambda step: config.lr * 0.5 * (1.0 + math.cos(math.pi * min(step, config.steps) / max(config.steps, 1)))
    return None
