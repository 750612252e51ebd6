"""DP-SGD for converted models: Poisson sampling, per-sample clipping, noise, EMA, accounting.

One logical step: draw a Poisson batch (rate q = batch_size / N), split it into
physical chunks that fit memory, compute each example's gradient averaged over
its K augmented views, clip it to `max_grad_norm`, sum, add N(0, (sigma C)^2)
once, divide by the expected batch size, and step the optimizer. The EMA and
the accountant advance once per logical step, and training stops before the
budget would be exceeded.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .accounting import PrivacyBudgetError, PrivacyLedger, calibrate_noise_multiplier, check_delta_for, default_delta
from .augment import augment_views, shift_set
from .callbacks import Callback, MetricsLogger, flat_metrics
from .checkpoint import CheckpointError, load, remove_stale_temporaries, save_atomic
from .distributed import SINGLE_PROCESS, DistributedContext
from .dp_safety import check_dp_safe
from .ema import ExponentialMovingAverage
from .metrics import classification_metrics, predict
from .bookkeeping import (
    BookkeepingUnsupportedError,
    check_bookkeeping_supported,
    per_sample_gradients_bookkeeping,
    verify_bookkeeping,
)
from .filter_gradients import FILTER_GRADIENT_METHODS, filter_gradient_method
from .inputs import check_images, check_labels
from .nonfinite import zero_nonfinite_examples
from .per_sample import clip_and_sum, per_sample_gradients
from .train_data import StreamedData, TensorData as TensorSource, TrainData, as_train_data
from .sampling import PoissonSampler, physical_chunks
from .secure_rng import NOISE, SAMPLING, make_source, warn_not_private
from .validate import validate_dp_safe

TensorData = tuple[torch.Tensor, torch.Tensor]
CUSTOM = "custom"  # a callable given to DPTrainer (optimizer factory, lr schedule)
OPTIMIZERS = ("sgd", "nadam", CUSTOM)
# loss_fn(logits (N, classes), labels (N,)) -> per-example losses (N,)
PerExampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# augment(images (B, C, H, W) on the device, K, generator) -> views (B, K, C, H, W), view 0 the image itself
Augment = Callable[[torch.Tensor, int, torch.Generator], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
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


class DPTrainer:
    """Train a model with DP-SGD; see DPConfig for the options (passed as keyword arguments).

    lr_schedule: "constant", "cosine", or a callable step -> learning rate (the schedule hook).
    optimizer: "sgd", "nadam", or a factory params -> torch.optim.Optimizer (e.g. functools.partial(AdamW, lr=1e-3)).
    loss_fn: logits, labels -> per-example losses (default: cross-entropy); book-keeping and vmap both use it.
    augment: images, K, generator -> K views per image on the device (default: reflect-pad crop and flip).
    callbacks: Callback objects (on_step_end, on_eval_end); metrics_logger: a MetricsLogger fed each log record.
    distributed: this process's rank in a data-parallel job (distributed.py); None for a single process.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device | None = None,
        out_dir: str | Path | None = None,
        lr_schedule: str | Callable[[int], float] = "constant",
        progress: bool = True,
        distributed: DistributedContext | None = None,
        loss_fn: PerExampleLoss | None = None,
        augment: Augment | None = None,
        callbacks: Sequence[Callback] = (),
        metrics_logger: MetricsLogger | None = None,
        **options: Any,
    ) -> None:
        optimizer_factory = options.pop("optimizer") if callable(options.get("optimizer")) else None
        if optimizer_factory is not None:
            options["optimizer"] = CUSTOM
        _check_hooks(loss_fn, augment, callbacks, metrics_logger)
        unknown = set(options) - set(DPConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown DPTrainer options {sorted(unknown)}; known: {sorted(DPConfig.__dataclass_fields__)}"
            )
        custom_schedule = None if isinstance(lr_schedule, str) else lr_schedule
        self.config = DPConfig(lr_schedule=CUSTOM_SCHEDULE if custom_schedule else lr_schedule, **options)
        check_config(self.config)
        if self.config.optimizer == CUSTOM and optimizer_factory is None:
            raise ValueError(f"optimizer {CUSTOM!r} means a factory: pass optimizer=<callable params -> Optimizer>")
        self.optimizer_factory = optimizer_factory
        self.loss_fn = loss_fn or _cross_entropy
        self.augment = augment or self._crop_flip
        self.callbacks = tuple(callbacks)
        self.metrics_logger = metrics_logger
        validate_dp_safe(model)
        if self.config.insecure_seeded_noise:
            warn_not_private("insecure_seeded_noise")
        self.per_sample_method = self._resolve_per_sample_method(model)
        self._bookkeeping_verified = False  # verify_bookkeeping runs once, at the first per-sample computation
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = model.to(self.device)
        self.dist = distributed or SINGLE_PROCESS  # [distributed] every rank starts from rank 0's weights
        self.dist.broadcast_module(self.model)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.lr_schedule = custom_schedule or _named_schedule(self.config)
        self.progress = progress and self.dist.is_main
        self.optimizer = self._make_optimizer()
        self.ema = ExponentialMovingAverage(self.model, self.config.ema_decay) if self.config.ema_decay else None
        if self.ema is not None and (unreached := self.ema.unreached_warning(self.config.steps)):
            warnings.warn(unreached)
        self.step = 0
        self.stopped_reason: str | None = None  # "budget" or "time_limit" when fit ended before `steps`
        self.history: list[dict[str, Any]] = []
        self._written = 0  # history[:_written] is in the log
        self.ledger: PrivacyLedger | None = None
        self.sampler: PoissonSampler | None = None
        self.noise_multiplier: float | None = None
        self.delta: float | None = None  # the run's delta: the configured one, else default_delta(N)
        self._nonfinite = torch.zeros((), dtype=torch.int64, device=self.device)  # examples zeroed (nonfinite.py)
        self._normalization = _normalization(self.config, self.device)
        self._augment_rng = torch.Generator(device=self.device).manual_seed(self.dist.rank_seed(self.config.seed + 1))
        # noise: rank 0's source is the job's only one; sampling: each rank its own (its shard's) stream
        insecure = self.config.insecure_seeded_noise
        self._noise_source = make_source(NOISE, self.config.seed if insecure else None, self.device)
        self._sampling_source = make_source(SAMPLING, self.dist.rank_seed(self.config.seed) if insecure else None)

    @property
    def private(self) -> bool:
        """Whether the noise and the sampling are secret (False under insecure_seeded_noise)."""
        return not self.config.insecure_seeded_noise

    @property
    def nonfinite_gradients(self) -> int:
        """Examples whose non-finite gradient was set to zero so far (over all ranks; waits for the device)."""
        return int(self._nonfinite)

    # --- set-up ------------------------------------------------------------
    def _resolve_per_sample_method(self, model: nn.Module) -> str:
        """The method this run uses; "auto" takes book-keeping when the model's static check allows it."""
        requested = self.config.per_sample_method
        if requested == "vmap":
            return "vmap"
        try:
            check_bookkeeping_supported(model)
        except BookkeepingUnsupportedError as error:
            if requested == "bookkeeping":
                raise
            if self.config.precision != "fp32":
                raise self._precision_needs_bookkeeping(error) from error
            return "vmap"
        return "bookkeeping"

    def _precision_needs_bookkeeping(self, error: Exception) -> BookkeepingUnsupportedError:
        """Where "auto" would fall back to vmap: vmap runs in fp32 only, so a bf16 run stops instead."""
        return BookkeepingUnsupportedError(
            f"precision {self.config.precision!r} needs book-keeping, which this model "
            f"cannot use ({error}); train it with precision 'fp32'"
        )

    def _make_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]  # frozen ones: no gradient, no noise
        if self.optimizer_factory is not None:
            optimizer = self.optimizer_factory(params)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
            return optimizer
        if self.config.optimizer == "nadam":
            return torch.optim.NAdam(params, lr=self.config.lr)
        return torch.optim.SGD(params, lr=self.config.lr, momentum=self.config.momentum)

    def _prepare_privacy(self, num_examples: int) -> None:
        c = self.config
        self.delta = check_delta_for(default_delta(num_examples) if c.delta is None else c.delta, num_examples)
        self.sampler = PoissonSampler(num_examples, c.batch_size, self._sampling_source, shard=self.dist.shard())
        sample_rate = self.sampler.sample_rate
        if c.noise_multiplier is not None:
            self.noise_multiplier = c.noise_multiplier
        else:
            self.noise_multiplier = calibrate_noise_multiplier(
                c.target_epsilon, self.delta, sample_rate, c.steps, c.accountant
            )
        self.ledger = PrivacyLedger(c.accountant, self.delta, c.target_epsilon, sample_rate, self.noise_multiplier)

    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = images.float().div_(255.0)
        mean, std = self._normalization
        if isinstance(mean, torch.Tensor) and images.dim() >= 3 and images.shape[-3] != mean.shape[0]:
            raise ValueError(
                f"normalize_mean/normalize_std give {mean.shape[0]} channels; the images have "
                f"{images.shape[-3]}: give one value per image channel, or one value"
            )
        return (images - mean) / std

    def _crop_flip(self, images: torch.Tensor, num_views: int, generator: torch.Generator) -> torch.Tensor:
        """The default augmentation: reflect-pad random crops and horizontal flips (augment.py)."""
        return augment_views(images, num_views, generator, self.config.augment_padding, self.config.augment_flip)

    # --- one logical step --------------------------------------------------
    def _noisy_gradient(
        self, data: TrainData | torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The noisy mean gradient of the trainable parameters in one logical step, its batch size, mean training
        loss and count of non-finite per-example gradients (device tensors: nothing here waits for the device).
        `data`: TrainData, or images with their `labels`."""
        c = self.config
        if labels is not None:
            data = TensorSource(data, labels)
        indices = self.sampler.sample()
        count = torch.full((), float(len(indices)), device=self.device)
        indices = _to_device(indices, data.device)  # where the data are (fit moves them to the device)
        params = {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}
        buffers = dict(self.model.named_buffers())
        summed = {n: torch.zeros_like(p) for n, p in params.items()}
        loss_sum = torch.zeros((), device=self.device)
        nonfinite = 0
        for chunk in physical_chunks(indices, c.physical_batch_size):
            chunk_images, chunk_labels = data.gather(chunk)
            views = self.augment(self._normalize(chunk_images), c.aug_mult, self._augment_rng)
            chunk_labels = chunk_labels.to(self.device)
            grads, losses = self._per_sample_gradients(params, buffers, views, chunk_labels)
            loss_sum += losses.detach().sum()
            grads, bad = zero_nonfinite_examples(grads)
            nonfinite += bad
            clipped, _ = clip_and_sum(grads, c.max_grad_norm)
            for name, value in clipped.items():
                summed[name] += value
        std = self.noise_multiplier * c.max_grad_norm
        if self.dist.is_main:  # [distributed] rank 0's noise source is the job's only one: noise enters once
            summed = {name: value + self._noise_source.gaussian(value.shape, std) for name, value in summed.items()}
        nonfinite = torch.as_tensor(nonfinite, device=self.device, dtype=torch.float32)
        *reduced, loss_sum, count, nonfinite = self.dist.all_reduce_sum(  # [distributed]
            [*summed.values(), loss_sum, count, nonfinite]
        )
        noisy = {name: value / c.batch_size for name, value in zip(summed, reduced)}
        return noisy, count, loss_sum / count.clamp_min(1.0), nonfinite.round().long()

    def _per_sample_gradients(self, params, buffers, views, labels) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        with filter_gradient_method(self.config.filter_gradients):  # the probe checks the kernel the run uses
            if self.per_sample_method == "bookkeeping" and not self._bookkeeping_verified:
                self._verify_bookkeeping(tuple(views.shape[1:]))
            if self.per_sample_method == "bookkeeping":
                return per_sample_gradients_bookkeeping(
                    self.model, views, labels, self._loss, autocast_dtype=PRECISIONS[self.config.precision]
                )
        return per_sample_gradients(self.model, params, buffers, views, labels, self._loss)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """loss_fn in F.cross_entropy's calling convention: book-keeping asks for one loss per view
        (reduction "none"), vmap for one example's loss averaged over its views."""
        losses = self.loss_fn(logits, labels)
        if losses.shape != labels.shape:
            raise ValueError(
                f"loss_fn must return one loss per example, shape {tuple(labels.shape)}; got {tuple(losses.shape)}"
            )
        return losses if reduction == "none" else losses.mean()

    def _verify_bookkeeping(self, view_shape: tuple[int, ...]) -> None:
        """The probe of verify_bookkeeping; "auto" falls back to vmap where it fails, "bookkeeping" raises.

        The probe uses random inputs and leaves every RNG as it was, so a resumed run decides the same.
        """
        try:
            verify_bookkeeping(self.model, view_shape, self._loss)
        except Exception as error:  # noqa: BLE001  (any failure of the probe: vmap is always exact)
            if self.config.per_sample_method == "bookkeeping":
                raise
            if self.config.precision != "fp32":
                raise self._precision_needs_bookkeeping(error) from error
            warnings.warn(f"per-sample gradients: book-keeping cannot run this model ({error}); using vmap")
            self.per_sample_method = "vmap"
        self._bookkeeping_verified = True

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        """One DP-SGD step on the private data (images, labels); returns its log record."""
        return _materialize([self._train_step(TensorSource(images, labels))])[0]

    def _train_step(self, data: TrainData) -> dict[str, Any]:
        """One DP-SGD step whose record keeps device tensors (batch_size, train_loss): no host synchronisation."""
        self.model.train()
        if self.lr_schedule is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_schedule(self.step)
        gradients, batch, train_loss, nonfinite = self._noisy_gradient(data)
        self._nonfinite += nonfinite
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                param.grad = gradients[name]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ledger.step()
        self.step += 1
        if self.ema is not None:
            self.ema.update(self.model, self.step)
        record = {"step": self.step, "lr": self.optimizer.param_groups[0]["lr"]}
        if self._logs_epsilon(self.step):
            record["epsilon"] = self.ledger.epsilon
        if self.config.log_nonprivate_stats:
            record.update(batch_size=batch, train_loss=train_loss, nonfinite_gradients=nonfinite)
        return record

    # --- the run -----------------------------------------------------------
    def fit(
        self,
        train_set: TensorData | Any,
        eval_set: TensorData | Any | None = None,
        resume: bool = False,
        time_limit_s: float | None = None,
    ) -> list[dict[str, Any]]:
        """Train until `steps`, until one more step would exceed the budget, or until `time_limit_s`.

        A run stopped by the time limit writes a checkpoint (with out_dir), so
        `fit(..., resume=True)` continues it to the same end as an uninterrupted run. The data moves to the
        device once; a step waits for the device only where its record is written (every `epsilon_every` steps,
        evaluations, checkpoints), so `time_s` of the steps between is the time they were queued.
        """
        data = self._data(train_set, "the training data")
        if eval_set is not None:
            eval_set = self._data(eval_set, "the evaluation data")
        check_dp_safe(self.model, self._normalize(data.gather(torch.zeros(1, dtype=torch.long))[0]))
        if self.sampler is None:
            self._prepare_privacy(len(data))
        if self.out_dir is not None:
            remove_stale_temporaries(self.checkpoint_path())
        if resume:
            self._resume()
        budget_steps = self.ledger.max_steps() if self.config.target_epsilon is not None else self.config.steps
        if self.step == 0 and budget_steps == 0 and self.config.steps > 0:
            raise PrivacyBudgetError(
                f"one step at noise multiplier {self.noise_multiplier:g} and sample rate "
                f"{self.sampler.sample_rate:.3g} spends epsilon {self.ledger.epsilon_after(1):.3g} > the target {self.config.target_epsilon:g}: "
                "raise the target epsilon, lower the batch size, or raise the noise multiplier"
            )
        bar = _progress_bar(self.config.steps, self.step, self.progress)
        start = time.perf_counter()
        while self.step < self.config.steps:
            if self.step >= budget_steps:  # one more step would exceed target_epsilon
                self.stopped_reason = "budget"
                self._log({"event": "stopped", "reason": "budget", "step": self.step, "epsilon": self.ledger.epsilon})
                break
            record = self._train_step(data)
            record["time_s"] = time.perf_counter() - start
            self._log(record, defer=not self._logs_epsilon(self.step))
            for callback in self.callbacks:
                callback.on_step_end(self, record)
            bar.update(1)
            if "epsilon" in record:
                bar.set_postfix(eps=f"{record['epsilon']:.3f}")
            if eval_set is not None and self.config.eval_every and self.step % self.config.eval_every == 0:
                self._log({"step": self.step, "eval": self._evaluate_with_callbacks(eval_set)})
            if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
                self.save_checkpoint()
            if time_limit_s is not None and self.step < self.config.steps and self._time_is_up(start, time_limit_s):
                self.stopped_reason = "time_limit"
                self._log(
                    {"event": "stopped", "reason": "time_limit", "step": self.step, "epsilon": self.ledger.epsilon}
                )
                if self.out_dir is not None:
                    self.save_checkpoint()
                break
        bar.close()
        final = {"step": self.step, "epsilon": self.ledger.epsilon}
        if eval_set is not None:
            final["final_eval"] = self._evaluate_with_callbacks(eval_set)
        self._log(final)
        return self.history

    def _logs_epsilon(self, step: int) -> bool:
        """Whether step `step`'s record carries epsilon and is written at once (the loop's only waits)."""
        return step % self.config.epsilon_every == 0 or step == self.config.steps

    def _time_is_up(self, start: float, limit_s: float) -> bool:
        """Past the time limit. In a job all ranks stop together: rank 0's clock decides, at the steps that
        write their record (one broadcast there)."""
        if not self.dist.enabled:
            return time.perf_counter() - start >= limit_s
        return self._logs_epsilon(self.step) and self.dist.agree(time.perf_counter() - start >= limit_s, self.device)

    def _data(self, data: Any, what: str) -> TrainData:
        """`data` as TrainData, checked (a streamed set: its examples as they are read) and, in memory, on the
        device."""
        source = data if isinstance(data, TrainData) else as_train_data(data, what, self.config.data_in_memory_bytes)
        if isinstance(source, StreamedData):
            images, _ = source.gather(torch.zeros(1, dtype=torch.long))
            source.num_classes = self._num_classes(images)
            return source
        self._check_data(source.images, source.labels, what)
        return source.to(self.device)

    def _num_classes(self, images: torch.Tensor) -> int:
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            num_classes = self.model(self._normalize(images[:1].to(self.device))).shape[-1]
        self.model.train(was_training)
        return num_classes

    def _evaluate_with_callbacks(self, data: TrainData) -> dict[str, float]:
        metrics = self.evaluate(data)
        for callback in self.callbacks:
            callback.on_eval_end(self, metrics)
        return metrics

    def _check_data(self, images: torch.Tensor, labels: torch.Tensor, what: str) -> None:
        """Refuse non-finite images and labels that are not class indices of this model (inputs.py)."""
        check_images(images, what)
        if len(images) == 0:
            raise ValueError(f"{what} is empty")
        check_labels(labels, len(images), self._num_classes(images), what)

    def evaluate(self, data: TensorData | Any) -> dict[str, float]:
        """Metrics of the EMA weights (if any) on `data`, plus shift-averaged ones when test_shifts is set.

        In a job each rank scores its slice of `data` and the logits are all-gathered: every rank returns the
        metrics of the whole set (all ranks must call this together).
        """
        with self.ema.applied(self.model) if self.ema is not None else contextlib.nullcontext():
            return self._evaluate_model(data)

    def _evaluate_model(self, data: TensorData | Any) -> dict[str, float]:
        source = (
            data
            if isinstance(data, TrainData)
            else as_train_data(data, "the evaluation data", self.config.data_in_memory_bytes)
        )
        count = len(source)
        rows = range(count)[self.dist.row_slice(count)]  # [distributed] this rank's slice
        batch = self.config.eval_batch_size

        def metrics(shifts: tuple[tuple[int, int], ...] | None) -> dict[str, float]:
            outputs, labels = [], []
            for start in range(0, len(rows), batch):
                images, chunk_labels = source.gather(torch.tensor(rows[start : start + batch], dtype=torch.long))
                outputs.append(predict(self.model, images, batch, self.device, self._normalize, shifts))
                labels.append(chunk_labels.to(self.device))
            outputs = self.dist.all_gather_rows(torch.cat(outputs), count)
            labels = self.dist.all_gather_rows(torch.cat(labels), count)
            return classification_metrics(outputs, labels)

        plain = metrics(None)
        if self.config.test_shifts is None:
            return plain
        averaged = metrics(shift_set(self.config.test_shifts))
        return {**plain, **{f"shift_averaged_{name}": value for name, value in averaged.items()}}

    @property
    def epsilon(self) -> float:
        return self.ledger.epsilon if self.ledger is not None else 0.0

    # --- logging and checkpoints ------------------------------------------
    def _log(self, record: dict[str, Any], defer: bool = False) -> None:
        """Append `record` to the history; unless deferred, write every record not yet written (rank 0 only)."""
        self.history.append(record)
        if not defer:
            self._flush()

    def _flush(self) -> None:
        """Turn the device tensors of the unwritten records into numbers (one wait) and write them to the log."""
        pending = self.history[self._written :]
        _materialize(pending)
        self._written = len(self.history)
        if self.metrics_logger is not None and self.dist.is_main:
            for record in pending:
                if "step" in record and (values := flat_metrics(record)):
                    self.metrics_logger.log_metrics(values, int(record["step"]))
        if self.out_dir is not None and self.dist.is_main and pending:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "log.jsonl", "a") as handle:
                handle.writelines(json.dumps(record) + "\n" for record in pending)

    def checkpoint_path(self) -> Path:
        if self.out_dir is None:
            raise ValueError("checkpoints need out_dir")
        return self.out_dir / "checkpoint.pt"

    def save_checkpoint(self) -> None:
        """Rank 0 writes the job's state: the shared one once, each rank's own generators (all ranks call this)."""
        self._flush()
        ranks = self.dist.all_gather_object(self._rank_state())  # [distributed]
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
            "nonfinite_gradients": self.nonfinite_gradients,
            "world_size": self.dist.world_size,
            **ranks[0],
            "other_ranks": ranks[1:],
        }
        save_atomic(state, self.checkpoint_path())

    def _rank_state(self) -> dict[str, Any]:
        """What differs between the ranks of a job: the sampler of its shard and its generators."""
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
        path = self.checkpoint_path()
        found = self.dist.all_gather_object(path.exists())  # [distributed] every rank reads rank 0's file
        if not any(found):
            raise CheckpointError(f"nothing to resume: no checkpoint at {path}; start without resuming")
        if not all(found):
            raise FileNotFoundError(
                f"{path} exists on ranks {[r for r, f in enumerate(found) if f]} only: a job "
                "resumes from one checkpoint, so --out must be on a file system every node sees"
            )
        state = load(path)
        saved_world_size = state.get("world_size", 1)
        if saved_world_size != self.dist.world_size:
            raise ValueError(
                f"checkpoint {path} was written by a job of {saved_world_size} process(es); this job "
                f"has {self.dist.world_size}: resume it with {saved_world_size} (each rank continues "
                "its own shard's sampler), or give a new --out"
            )
        saved, current = _resume_identity(state["config"]), _resume_identity(asdict(self.config))
        if saved != current:
            differing = {
                key: (saved.get(key), current.get(key)) for key in current if saved.get(key) != current.get(key)
            }
            raise ValueError(
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
        self.step = state["step"]


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
    _check_normalization(c.normalize_mean, c.normalize_std)
    if c.data_in_memory_bytes < 0:
        raise ValueError(
            f"data_in_memory_bytes must be >= 0 (0: always stream a Dataset), got {c.data_in_memory_bytes}"
        )
    if c.augment_padding < 0:
        raise ValueError(f"augment_padding (crop shift in pixels) must be >= 0, got {c.augment_padding}")


METHOD_ONLY_OPTIONS = ("per_sample_method", "data_in_memory_bytes")  # how gradients are computed, not what they are
EVALUATION_ONLY_OPTIONS = ("test_shifts",)  # what evaluations also report, not what is trained


def _resume_identity(config: dict[str, Any]) -> dict[str, Any]:
    """The options a resumed run must share with its checkpoint.

    An option added after the checkpoint was written counts at its default, the behaviour of the version that
    wrote it (new options default to the old behaviour: precision "fp32").
    """
    full = {**asdict(DPConfig()), **config}
    return {key: value for key, value in full.items() if key not in METHOD_ONLY_OPTIONS + EVALUATION_ONLY_OPTIONS}


def _named_schedule(config: DPConfig) -> Callable[[int], float] | None:
    """The learning rate of step t (0-based) for config.lr_schedule; None keeps the optimizer's lr."""
    if config.lr_schedule == "cosine":
        return lambda step: config.lr * 0.5 * (1.0 + math.cos(math.pi * min(step, config.steps) / max(config.steps, 1)))
    return None


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; a host-to-GPU copy goes through pinned memory, so the host does not wait for it."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _materialize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replace the tensors in `records` (in place) by numbers, copying them all to the host at once."""
    places = [(record, key) for record in records for key, value in record.items() if isinstance(value, torch.Tensor)]
    if places:
        values = torch.stack([record[key].detach().float().reshape(()) for record, key in places]).tolist()
        for (record, key), value in zip(places, values):
            record[key] = int(value) if key in INTEGER_FIELDS else value
    return records


INTEGER_FIELDS = ("batch_size", "nonfinite_gradients")  # record fields that are counts


def _channel_values(value: float | Sequence[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (tuple, list)) else (float(value),)


def _normalization(config: DPConfig, device: torch.device) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """(mean, std): numbers when both are one value, else (C, 1, 1) tensors on `device`, made once (a copy to the
    device at every step would wait for it)."""
    mean, std = _channel_values(config.normalize_mean), _channel_values(config.normalize_std)
    channels = max(len(mean), len(std))
    if channels == 1:
        return mean[0], std[0]
    return tuple(
        torch.tensor(values, device=device).expand(channels).reshape(channels, 1, 1).clone() for values in (mean, std)
    )


def _check_normalization(mean: Any, std: Any) -> None:
    """normalize_mean/normalize_std: finite numbers, one or one per channel, std > 0, the same channel count."""
    values = {}
    for name, value in (("normalize_mean", mean), ("normalize_std", std)):
        try:
            values[name] = _channel_values(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"{name} must be a number or a tuple of numbers (one per channel), got {value!r}"
            ) from None
        if not values[name] or not all(math.isfinite(v) for v in values[name]):
            raise ValueError(f"{name} must be finite numbers, one or one per channel, got {value!r}")
    if not all(v > 0 for v in values["normalize_std"]):
        raise ValueError(f"normalize_std must be > 0 in every channel, got {std!r}")
    lengths = {len(v) for v in values.values()} - {1}
    if len(lengths) > 1:
        raise ValueError(f"normalize_mean {mean!r} and normalize_std {std!r} give different channel counts")


def _check_hooks(loss_fn: Any, augment: Any, callbacks: Any, metrics_logger: Any) -> None:
    """The callables and objects given to DPTrainer, checked before anything is built (errors name the option)."""
    for name, value in (("loss_fn", loss_fn), ("augment", augment)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable, got {type(value).__name__}")
    for callback in callbacks:
        if not isinstance(callback, Callback):
            raise TypeError(
                f"callbacks must be equiconvert.privacy.callbacks.Callback objects, got {type(callback).__name__}"
            )
    if metrics_logger is not None and not isinstance(metrics_logger, MetricsLogger):
        raise TypeError(f"metrics_logger must have log_metrics(metrics, step), got {type(metrics_logger).__name__}")


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="DP-SGD", unit="step")


def _tensors(data: TensorData | Any) -> TensorData:
    """(images, labels) of tensors or a TensorDataset (the audit's canary sets)."""
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0], data[1]
    if hasattr(data, "tensors") and len(data.tensors) == 2:  # torch.utils.data.TensorDataset
        return data.tensors
    raise TypeError("training data must be (images, labels) tensors or a TensorDataset of them")
