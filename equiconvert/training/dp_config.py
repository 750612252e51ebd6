"""The options of a DP-SGD run: DPConfig (each option's one default), the values allowed, and their check.

check_config runs before any data is loaded, so an option that cannot train fails at once, naming its field.
FIELD_LIMITS is the one table of each field's allowed values; the command line's recipe checks use it too.
An option that can be off is off when None (OFF_OPTIONS); 0 is read as None (a recipe, TOML having no null,
writes off as 0).

Importing this module loads no torch (`equiconvert train --help` shows DPConfig's defaults): FIELD_LIMITS and
PER_SAMPLE_METHODS are read from the privacy registries when used, and the optimizers import torch when built.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ParameterError, UsageError
from ..privacy.accountant_names import ACCOUNTANTS, RDP

if TYPE_CHECKING:
    import torch

CUSTOM = "custom"  # a callable given to DPTrainer (optimizer factory, lr schedule)
CUSTOM_SCHEDULE = CUSTOM  # a callable step -> lr given to DPTrainer
LR_SCHEDULES = ("constant", "cosine", CUSTOM_SCHEDULE)
DEFAULT_EMA_DECAY = 0.999


def _sgd(params: list[torch.nn.Parameter], config: DPConfig) -> torch.optim.Optimizer:
    import torch

    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum)


def _nadam(params: list[torch.nn.Parameter], config: DPConfig) -> torch.optim.Optimizer:
    import torch

    return torch.optim.NAdam(params, lr=config.lr)


# DPConfig.optimizer's names -> the optimizer each builds on the trainable parameters (CUSTOM: DPTrainer's factory)
OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter], DPConfig], torch.optim.Optimizer]] = {
    "sgd": _sgd,
    "nadam": _nadam,
}


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
    ema_decay: float | None = DEFAULT_EMA_DECAY
    accountant: str = RDP
    noise_multiplier: float | None = None  # None: calibrated from target_epsilon
    physical_batch_size: int = 256
    # pad each physical batch with blank rows, which add exactly zero and are never counted (chunk_padding.py), to a
    # multiple of this many, so that the step sees a few input shapes instead of one per Poisson batch size; 1: none
    physical_batch_multiple: int = 1
    # CUDA: cuDNN times its convolution algorithms once per input shape and keeps the fastest for the run; pair it
    # with physical_batch_multiple, or every new size of a step's last physical batch is timed again
    cudnn_benchmark: bool = False
    # CUDA: each physical batch of physical_batch_size examples replays one captured CUDA graph of its clipped sum
    # instead of launching its ~1,700 operators (graphed_chunks.py); pair it with physical_batch_multiple =
    # physical_batch_size so that every physical batch has that size (others run eagerly). Off CUDA the same path
    # runs without a graph, with the same results
    cuda_graph: bool = False
    augment_padding: int = 4
    augment_flip: bool = True
    normalize_mean: float | tuple[float, ...] = 0.5  # one value, or one per channel
    normalize_std: float | tuple[float, ...] = 0.5
    # a Dataset (or DataLoader) whose images take at most this many bytes is read once into tensors on the
    # device; a larger one is streamed (each step reads its sampled examples through the Dataset)
    data_in_memory_bytes: int = 2**30
    # initial weights (set by the caller), augmentation (a private run's until its first checkpoint re-keys it) and
    # data order; never the noise or sampling
    seed: int = 0
    # NOT private: seed the noise and the Poisson sampling from `seed` (tests, debugging); the default draws them from
    # the operating system's CSPRNG (secure_rng), and anyone with the seed could subtract the noise
    insecure_seeded_noise: bool = False
    eval_every: int | None = None
    eval_batch_size: int = 1024
    # with out_dir, a checkpoint every this many steps, besides those at each evaluation, a time-limit stop and the
    # end: what a killed run resumes from
    checkpoint_every: int | None = 100
    # NOT private: log each step's noise-free mean training loss and actual Poisson batch size (and count of
    # non-finite per-example gradients), statistics of the private data released without noise
    log_nonprivate_stats: bool = False
    # NOT covered by the guarantee: each step's record carries the run's elapsed time, so a step's duration, which
    # grows with its secret Poisson batch size, can be read off the log; by default only evaluations, stops and the
    # end carry it
    log_step_times: bool = False
    epsilon_every: int = 10  # log epsilon every this many steps (PRV's get_epsilon is slow)
    # "bookkeeping": fastest and leanest measured (benchmarks/throughput.py, H200); "vmap": torch.func, for any
    # model; "auto": bookkeeping unless the model fails its checks (static, then a probe at the first step), then vmap
    per_sample_method: str = "auto"
    # "bf16": the forward and backward of the per-sample computation under bf16 autocast (book-keeping only;
    # tensor-core speed); each example's gradient is formed, clipped and noised in fp32, so the privacy bound holds
    precision: str = "fp32"
    # book-keeping's per-example conv filter gradients (privacy/filter_gradients.py): "auto" times every kernel per
    # layer on CUDA (on random stand-ins of physical_batch_size examples: a chunk's own size can be secret) and keeps
    # the fastest, and uses the grouped weight gradient on CPU; "products", "grouped",
    # "unfolded", "triton" or "triton_taps" (both CUDA only) fixes it
    filter_gradients: str = "auto"
    # a name in augment.TEST_SHIFTS: every evaluation also reports "shift_averaged_*" metrics, the softmax averaged
    # over those shifted copies of each test image (post-processing: no privacy cost); the plain metrics are kept
    test_shifts: str | None = None

    def __post_init__(self) -> None:
        for name in OFF_OPTIONS:  # 0 is read as off: TOML, which recipes are written in, has no null
            value = getattr(self, name)
            if value == 0 and not isinstance(value, bool):
                setattr(self, name, None)


# the options that None (or 0) turns off, and what off means
OFF_OPTIONS = {
    "ema_decay": "no EMA",
    "eval_every": "evaluate after the last step only",
    "checkpoint_every": "no periodic checkpoints",
}

Limit = tuple[Callable[[Any], bool], str]  # the test of a value, and the rule an error states


def _is_number(value: Any) -> bool:
    """A finite real number: an inf learning rate or clip norm would make every weight NaN after one step."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_integer(value: Any) -> bool:
    """An integer (Python's or NumPy's): a count such as batch_size=2.5 would be sampled and accounted as 2 but
    divided by as 2.5."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _at_least(low: int, note: str = "") -> Limit:
    return (lambda v: _is_integer(v) and v >= low, f"must be an integer >= {low}" + (f" ({note})" if note else ""))


def _above(low: float) -> Limit:
    return (lambda v: _is_number(v) and v > low, f"must be a finite number > {low:g}")


def _within(low: float, high: float, low_open: bool = True) -> Limit:
    def valid(v: Any) -> bool:
        return _is_number(v) and (low < v if low_open else low <= v) and v < high

    return (valid, f"must be in {'(' if low_open else '['}{low:g}, {high:g})")


def _one_of(names: tuple[str, ...]) -> Limit:
    return (lambda v: v in names, f"must be one of {names}")


def _per_sample_methods() -> tuple[str, ...]:
    """AUTO and the registered back-ends' methods (privacy.backends)."""
    from ..privacy.backends import AUTO, backend_methods

    return (AUTO, *backend_methods())


def _field_limits() -> dict[str, Limit]:
    """DPConfig field -> its limit; None is not tested in a field that may be None (its comment or OFF_OPTIONS says
    what None means)."""
    from ..privacy.backends import PRECISIONS
    from ..privacy.filter_gradients import FILTER_GRADIENT_METHODS

    return {
        "target_epsilon": _above(0),
        "delta": _within(0, 1),
        "noise_multiplier": _above(0),
        "batch_size": _at_least(1),
        "steps": _at_least(0),
        "aug_mult": _at_least(1),
        "max_grad_norm": _above(0),
        "lr": _above(0),
        "momentum": _within(0, 1, low_open=False),
        "optimizer": _one_of((*OPTIMIZERS, CUSTOM)),
        "lr_schedule": _one_of(LR_SCHEDULES),
        "ema_decay": _within(0, 1),
        "accountant": _one_of(ACCOUNTANTS),
        "physical_batch_size": _at_least(1),
        "physical_batch_multiple": _at_least(1, "1: no padding"),
        "augment_padding": _at_least(0, "the crops' shift in pixels"),
        # one value; per-channel values: check_normalization
        "normalize_std": (lambda v: not _is_number(v) or v > 0, "must be > 0"),
        "data_in_memory_bytes": _at_least(0, "0: always stream a Dataset"),
        "eval_every": _at_least(1),
        "eval_batch_size": _at_least(1),
        "checkpoint_every": _at_least(1),
        "epsilon_every": _at_least(1),
        "per_sample_method": _one_of(_per_sample_methods()),
        "precision": _one_of(tuple(PRECISIONS)),
        "filter_gradients": _one_of(FILTER_GRADIENT_METHODS),
    }


_OPTIONAL = frozenset(f.name for f in dataclasses.fields(DPConfig) if "None" in str(f.type))


# the names read from the privacy registries (torch) when used: module attribute -> its builder
_REGISTRY_NAMES: dict[str, Callable[[], Any]] = {
    "FIELD_LIMITS": _field_limits,
    "PER_SAMPLE_METHODS": _per_sample_methods,
}


def __getattr__(name: str) -> Any:
    """FIELD_LIMITS and PER_SAMPLE_METHODS, built from the registries as they are now (PEP 562)."""
    if name in _REGISTRY_NAMES:
        return _REGISTRY_NAMES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class ConfigError(UsageError, ValueError):
    """A DPConfig field whose value breaks its rule; field, value and rule let a caller name its own flag."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        self.field, self.value, self.rule = field, value, rule
        off = f" (None: {OFF_OPTIONS[field]})" if field in OFF_OPTIONS else ""
        super().__init__(f"{field} {rule}, got {value!r}{off}")


def check_config(c: DPConfig) -> None:
    """Refuse options that cannot train (before any data is loaded); errors name the DPConfig field."""
    from ..privacy.backends import AUTO, backend_for
    from .augment import shift_set
    from .normalization import check_normalization

    for field, (valid, rule) in _field_limits().items():
        value = getattr(c, field)
        if not (value is None and field in _OPTIONAL or valid(value)):
            raise ConfigError(field, value, rule)
    if c.target_epsilon is None and c.noise_multiplier is None:
        raise ParameterError("give target_epsilon (sigma is calibrated) or noise_multiplier")
    if c.noise_multiplier is None and c.steps < 1:
        raise ConfigError("steps", c.steps, "must be >= 1 for the noise to be calibrated to the epsilon target")
    if c.physical_batch_size % c.physical_batch_multiple:
        raise ConfigError(
            "physical_batch_multiple",
            c.physical_batch_multiple,
            f"must divide physical_batch_size ({c.physical_batch_size}): only a step's last physical batch is padded",
        )
    if c.per_sample_method != AUTO:  # the registered back-ends: vmap runs in fp32 only
        backend_for(c.per_sample_method, c.precision)
    if c.test_shifts is not None:
        shift_set(c.test_shifts)
    check_normalization(c.normalize_mean, c.normalize_std)


def named_schedule(config: DPConfig) -> Callable[[int], float] | None:
    """The learning rate of step t (0-based) for config.lr_schedule; None keeps the optimizer's lr."""
    if config.lr_schedule == "cosine":
        return lambda step: config.lr * 0.5 * (1.0 + math.cos(math.pi * min(step, config.steps) / max(config.steps, 1)))
    return None
