"""DP-SGD for converted models: Poisson sampling, per-sample clipping, noise, EMA, accounting.

One logical step: draw a Poisson batch (rate q = batch_size / N), split it into
physical chunks that fit memory, compute each example's gradient averaged over
its K augmented views, clip it to `max_grad_norm`, sum, add N(0, (sigma C)^2)
once, divide by the expected batch size (privacy/dp_step.py), and step the optimizer. The EMA and
the accountant advance once per logical step, and training stops before the
budget would be exceeded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import signal
import time
import warnings
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn
from torch.profiler import record_function

from ..errors import ParameterError, ParameterTypeError
from ..progress import private_steps_bar
from ..privacy.accounting import (
    PrivacyBudgetError,
    PrivacyLedger,
    calibrate_noise_multiplier,
    check_delta_for,
    default_delta,
)
from ..privacy.buffer_guard import BufferGuard
from ..privacy.checkpoint import remove_stale_temporaries
from ..privacy.dp_safety import check_dp_safe
from ..privacy.dp_step import add_into, privatize
from ..privacy.per_sample_method import PerExampleLoss, PerSampleGradients
from ..privacy.sampling import PoissonSampler, physical_chunks
from ..privacy.secure_rng import NOISE, SAMPLING, make_source, warn_not_private
from ..privacy.shape_probe import BatchShapeProbe
from ..privacy.validate import validate_dp_safe
from .augment import augment_views, shift_set
from .callbacks import Callback, MetricsLogger
from .chunk_padding import ignoring_blank_rows, pad_with_blank_rows, real_rows
from .devices import cudnn_autotuning, resolve_device
from .distributed import SINGLE_PROCESS, DistributedContext
from .dp_config import CUSTOM, CUSTOM_SCHEDULE, OPTIMIZERS, DPConfig, check_config, named_schedule
from .ema import ExponentialMovingAverage
from .graphed_chunks import ChunkResult, GraphedChunks
from .hooks import Augment, OptimizerFactory, check_hooks, cross_entropy
from .inputs import InvalidDataError, check_images, check_labels, check_model_input
from .interrupt import DeferredInterrupt, TrainingInterrupted
from .loggers import DEFAULT_LOGGERS, LoggerSpec, build_loggers, check_loggers
from .metrics import classification_metrics, predict
from .normalization import Normalize
from .run_folder import EMPTY_OUT_RULE, OutputFolderError, names_no_folder
from .run_lock import hold_run_folder
from .run_log import RunClock, RunLog, materialize, warn_step_times
from .train_data import StreamedData, TensorData, TrainData, as_train_data
from .trainer_checkpoint import TrainerCheckpoint

ImagesAndLabels = tuple[torch.Tensor, torch.Tensor]  # (images, labels)


def _resolved_config(
    config: DPConfig | None, options: dict[str, Any], lr_schedule: str | Callable[[int], float], custom: bool
) -> DPConfig:
    """DPTrainer's DPConfig: `config` as given, or one built from DPConfig's fields given as keywords (not both).

    A callable `lr_schedule` or an optimizer factory (`custom`) sets the field to its "custom" name.
    """
    hooks = {
        **({"lr_schedule": CUSTOM_SCHEDULE} if not isinstance(lr_schedule, str) else {}),
        **({"optimizer": CUSTOM} if custom else {}),
    }
    if config is None:
        unknown = set(options) - set(DPConfig.__dataclass_fields__)
        if unknown:
            raise ParameterError(
                f"unknown DPTrainer options {sorted(unknown)}; known: {sorted(DPConfig.__dataclass_fields__)}"
            )
        return DPConfig(**{"lr_schedule": lr_schedule, **options, **hooks})
    if not isinstance(config, DPConfig):
        raise ParameterTypeError(f"config must be a DPConfig, got {type(config).__name__}")
    if options:
        raise ParameterError(
            f"give DPTrainer's options either as config= or as keywords, not both: config= and {sorted(options)}"
        )
    if isinstance(lr_schedule, str) and lr_schedule != DPConfig.lr_schedule:
        raise ParameterError(
            f"lr_schedule={lr_schedule!r} with config=: name the schedule in config.lr_schedule "
            "(the keyword beside config= takes a callable)"
        )
    return dataclasses.replace(config, **hooks) if hooks else config


class DPTrainer(TrainerCheckpoint):
    """Train a model with DP-SGD; see DPConfig for the options (a DPConfig as `config`, or its fields as keywords).

    Images are (N, C, H, W): uint8 pixels, or floats that are pixels in [0, 1] or already normalised (inputs.py).

    Args:
        model: the network to train (moved to `device`).
        device: "cpu", "cuda", "cuda:1", ...; None picks CUDA when there is one.
        out_dir: the run folder for log.jsonl, checkpoints and result files; None writes nothing.
        lr_schedule: "constant", "cosine", or a callable step -> learning rate (the schedule hook).
        progress: a progress bar on stderr (the main process only).
        distributed: this process's rank in a data-parallel job (distributed.py); None for a single process.
        loss_fn: logits, labels -> per-example losses (default: cross-entropy); every back-end uses it.
        augment: images, K, generator -> K views per image on the device (default: reflect-pad crop and flip).
        callbacks: Callback objects (on_step_end, on_eval_end).
        loggers: where the log records go, as names in loggers.LOGGERS (jsonl, csv, tensorboard, wandb; each
            writes into out_dir) or logger objects; every logger gets the records log.jsonl gets and nothing else.
        metrics_logger: one more logger object (a MetricsLogger).
        config: the run's options as one DPConfig (what a checked recipe gives); then **options holds at most
            an optimizer factory.
        **options: DPConfig's fields, when `config` is not given; `optimizer` is a name in dp_config.OPTIMIZERS
            or a factory params -> torch.optim.Optimizer (e.g. functools.partial(AdamW, lr=1e-3)).

    Raises:
        ParameterError: an option out of range or unknown, named by its parameter, before any data is read.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device | None = None,
        out_dir: str | Path | None = None,
        lr_schedule: str | Callable[[int], float] = DPConfig.lr_schedule,
        progress: bool = True,
        distributed: DistributedContext | None = None,
        loss_fn: PerExampleLoss | None = None,
        augment: Augment | None = None,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[LoggerSpec] = DEFAULT_LOGGERS,
        metrics_logger: MetricsLogger | None = None,
        config: DPConfig | None = None,
        **options: Any,
    ) -> None:
        optimizer_factory: OptimizerFactory | None = (
            options.pop("optimizer") if callable(options.get("optimizer")) else None
        )
        check_hooks(loss_fn, augment, callbacks, metrics_logger)
        check_loggers(loggers)
        custom_schedule = None if isinstance(lr_schedule, str) else lr_schedule
        self.config = _resolved_config(config, options, lr_schedule, custom=optimizer_factory is not None)
        check_config(self.config)
        if self.config.optimizer == CUSTOM and optimizer_factory is None:
            raise ParameterError(f"optimizer {CUSTOM!r} means a factory: pass optimizer=<callable params -> Optimizer>")
        self.optimizer_factory = optimizer_factory
        self.loss_fn = loss_fn or cross_entropy
        self.augment = augment or self._crop_flip
        self.callbacks = tuple(callbacks)
        self.metrics_logger = metrics_logger
        validate_dp_safe(model)
        if self.config.insecure_seeded_noise:
            warn_not_private("insecure_seeded_noise")
        if self.config.log_step_times:
            warn_step_times()
        padded = self.config.physical_batch_multiple > 1
        self._per_sample_gradients = PerSampleGradients(
            model,
            ignoring_blank_rows(self.loss_fn) if padded else self.loss_fn,
            self.config.per_sample_method,
            self.config.precision,
            self.config.filter_gradients,
            self.config.physical_batch_size,
        )
        self._buffer_guard: BufferGuard | None = None  # set by the DP-safety probe (_probe_once)
        self._shape_probe: BatchShapeProbe | None = None  # the cross-example probe at each new chunk shape
        self._graphed = (
            GraphedChunks(self._chunk_result, rows=self.config.physical_batch_size) if self.config.cuda_graph else None
        )
        self.device = resolve_device(device)
        self.model = model.to(self.device)
        self.dist = distributed or SINGLE_PROCESS  # [distributed] every rank starts from rank 0's weights
        self.dist.broadcast_module(self.model)
        if names_no_folder(out_dir):
            raise OutputFolderError(f"out_dir='' {EMPTY_OUT_RULE}, or None to write nothing")
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if self.out_dir is not None and self.out_dir.exists() and not self.out_dir.is_dir():
            raise ParameterError(f"out_dir {self.out_dir} is a file: give a folder for the run's log and checkpoints")
        self.lr_schedule = custom_schedule or named_schedule(self.config)
        self.progress = progress and self.dist.is_main
        self.optimizer = self._make_optimizer()
        decay = self.config.ema_decay
        self.ema = ExponentialMovingAverage(self.model, decay) if decay is not None else None
        if self.ema is not None and (unreached := self.ema.unreached_warning(self.config.steps)):
            warnings.warn(unreached)
        self.step = 0
        self.stopped_reason: str | None = None  # "budget", "time_limit" or "interrupted": fit ended before `steps`
        extra = [metrics_logger] if metrics_logger is not None else []
        logs = self.dist.is_main  # rank 0 alone writes the log
        self._log = RunLog(self.out_dir, build_loggers([*loggers, *extra], self.out_dir) if logs else [], logs)
        self._clock = RunClock()
        self._checkpoint_step: int | None = None  # the step of the last checkpoint this trainer wrote
        self.ledger: PrivacyLedger | None = None
        self.sampler: PoissonSampler | None = None
        self.noise_multiplier: float | None = None
        self.delta: float | None = None  # the run's delta: the configured one, else default_delta(N)
        # examples whose non-finite gradient was zeroed (privacy/nonfinite.py)
        self._nonfinite = torch.zeros((), dtype=torch.int64, device=self.device)
        self._normalize = Normalize(
            self.config.normalize_mean, self.config.normalize_std, self.device, _input_dtype(self.model)
        )
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
    def per_sample_method(self) -> str:
        """How this run computes per-example gradients, "bookkeeping", "ghost" or "vmap" (privacy/per_sample_method.py)."""
        return self._per_sample_gradients.method

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every log record of the run so far, in order."""
        return self._log.records

    @property
    def nonfinite_gradients(self) -> int:
        """Examples whose non-finite gradient was set to zero so far (over all ranks; waits for the device)."""
        return int(self._nonfinite)

    # --- set-up ------------------------------------------------------------
    def _make_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]  # frozen ones: no gradient, no noise
        if self.optimizer_factory is not None:
            optimizer = self.optimizer_factory(params)
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ParameterTypeError(
                    f"optimizer_factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer"
                )
            return optimizer
        return OPTIMIZERS[self.config.optimizer](params, self.config)

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
            data = TensorData(data, labels)
        self._probe_once(data)
        with record_function("equiconvert/sample"):
            indices = self.sampler.sample()
            count = torch.full((), float(len(indices)), device=self.device)
            indices = _to_device(indices, data.device)  # where the data are (fit moves them to the device)
        params = {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}
        buffers = dict(self.model.named_buffers())
        summed = {n: torch.zeros_like(p) for n, p in params.items()}
        loss_sum = torch.zeros((), device=self.device)
        nonfinite = 0
        for chunk in physical_chunks(indices, c.physical_batch_size):
            with record_function("equiconvert/gather_and_augment"):
                chunk_images, chunk_labels = data.gather(chunk)
                views = self.augment(self._normalize(chunk_images), c.aug_mult, self._augment_rng)
                chunk_labels = chunk_labels.to(self.device)
                real = None  # every row is an example
                if c.physical_batch_multiple > 1:  # after the augmentation, which draws for the real examples only
                    views, chunk_labels = pad_with_blank_rows(views, chunk_labels, c.physical_batch_multiple)
                    real = real_rows(chunk_labels)  # blank rows add zero and are never counted as non-finite
            self._shape_probe.check(views.flatten(0, 1))  # e.g. the last, smaller chunk, the first time
            with self._buffer_guard.watch(views.flatten(0, 1)):
                if self._graphed is None:
                    losses, chunk_nonfinite = self._per_sample_gradients.accumulate_clipped(
                        params, buffers, views, chunk_labels, c.max_grad_norm, into=summed, real=real
                    )
                else:  # the graph's outputs are read (add_into) before its next replay
                    losses, chunk_nonfinite, clipped = self._graphed(views, chunk_labels, real)
                    add_into(summed, clipped)
            loss_sum += losses.detach().sum()
            nonfinite += chunk_nonfinite
        with record_function("equiconvert/noise"):
            noisy = privatize(
                summed,
                self.noise_multiplier,
                c.max_grad_norm,
                self._noise_source,
                divisor=c.batch_size,
                add_noise=self.dist.is_main,  # [distributed] rank 0's noise source is the job's only one
                all_reduce=self.dist.all_reduce_sum,
            )
        nonfinite = torch.as_tensor(nonfinite, device=self.device, dtype=torch.float32)
        loss_sum, count, nonfinite = self.dist.all_reduce_sum([loss_sum, count, nonfinite])  # [distributed]
        return noisy, count, loss_sum / count.clamp_min(1.0), nonfinite.round().long()

    def _chunk_result(self, views: torch.Tensor, labels: torch.Tensor, real: torch.Tensor | None) -> ChunkResult:
        """One physical batch's losses, non-finite count and clipped sum, in tensors of its own (what
        GraphedChunks captures and replays)."""
        params = {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}
        clipped: dict[str, torch.Tensor] = {}
        losses, nonfinite = self._per_sample_gradients.accumulate_clipped(
            params, dict(self.model.named_buffers()), views, labels, self.config.max_grad_norm, into=clipped, real=real
        )
        if not isinstance(nonfinite, torch.Tensor):  # 0: no per-example gradients
            nonfinite = torch.zeros((), dtype=torch.int64, device=views.device)
        return ChunkResult(losses, nonfinite, clipped)

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        """One DP-SGD step on the private data (images, labels); returns its log record."""
        record = self._train_step(TensorData(images, labels))
        self._verify_buffers()
        return materialize([record])[0]

    def _train_step(self, data: TrainData) -> dict[str, Any]:
        """One DP-SGD step whose record keeps device tensors (batch_size, train_loss): no host synchronisation."""
        self.model.train()
        if self.lr_schedule is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_schedule(self.step)
        gradients, batch, train_loss, nonfinite = self._noisy_gradient(data)
        self._nonfinite += nonfinite
        with record_function("equiconvert/update_and_ema"):
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
        if self._logs_epsilon(self.step):  # a step that waits for the device anyway: the buffer checks are read
            self._verify_buffers()
            record["epsilon"] = self.ledger.epsilon
        if self.config.log_nonprivate_stats:
            record.update(batch_size=batch, train_loss=train_loss, nonfinite_gradients=nonfinite)
        return record

    # --- the run -----------------------------------------------------------
    def fit(
        self,
        train_set: ImagesAndLabels | Any,
        eval_set: ImagesAndLabels | Any | None = None,
        resume: bool = False,
        time_limit_s: float | None = None,
    ) -> list[dict[str, Any]]:
        """Train until `steps`, until one more step would exceed the budget, or until `time_limit_s`.

        With out_dir, a checkpoint is written at each evaluation, every `checkpoint_every` steps, when the time
        limit stops the run and at the end, so `fit(..., resume=True)` continues it to the same end as an
        uninterrupted run. Evaluations, stops and the final record carry the run's elapsed `time_s`; step
        records carry it only under `log_step_times` (it times the secret batches). The data moves to the
        device once; a step waits for the device only where its record is written (every `epsilon_every` steps,
        evaluations, checkpoints), so a step's `time_s` between those is the time it was queued. While it writes
        there, the run holds out_dir's lock: another job training into it is refused (run_lock.py). Ctrl-C or SIGTERM
        stops the run (every rank of a job at the same step) after the step under way with a checkpoint and raises
        TrainingInterrupted (interrupt.py).
        """
        with contextlib.ExitStack() as self._run_folder, DeferredInterrupt() as self._interrupt:
            self._run_folder.callback(self._log.close)
            self._run_folder.enter_context(cudnn_autotuning(self.config.cudnn_benchmark and self.device.type == "cuda"))
            return self._fit(train_set, eval_set, resume, time_limit_s)

    def _fit(
        self, train_set: Any, eval_set: Any | None, resume: bool, time_limit_s: float | None
    ) -> list[dict[str, Any]]:
        train_source = self._source(train_set, "the training data")
        self._probe_once(train_source)
        data = self._checked(train_source, "the training data")
        if eval_set is not None:
            eval_set = self._checked(self._source(eval_set, "the evaluation data"), "the evaluation data")
        if self.sampler is None:
            self._prepare_privacy(len(data))
        if self.out_dir is not None:
            self._run_folder.enter_context(hold_run_folder(self.out_dir if self.dist.is_main else None))
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
        bar = private_steps_bar(
            "DP-SGD", self.progress, self.config.steps, initial=self.step, step_times=self.config.log_step_times
        )
        start = time.perf_counter()
        self._clock.start()
        while self.step < self.config.steps:
            if (stop := self._stop_signal()) is not None:  # Ctrl-C or SIGTERM: stop here, between two steps
                raise self._interrupted(stop)
            if self.step >= budget_steps:  # one more step would exceed target_epsilon
                self.stopped_reason = "budget"
                self._log.append({"event": "stopped", "reason": "budget", **self._progress_fields()})
                break
            record = self._train_step(data)
            if self.config.log_step_times:
                record["time_s"] = self._clock.elapsed()
            self._log.append(record, defer=not self._logs_epsilon(self.step))
            for callback in self.callbacks:
                callback.on_step_end(self, record)
            bar.update(1)
            if "epsilon" in record:
                bar.set_postfix(eps=f"{record['epsilon']:.3f}")
            if eval_set is not None and self.config.eval_every and self.step % self.config.eval_every == 0:
                evaluation = self._evaluate_with_callbacks(eval_set)
                self._log.append({"step": self.step, "eval": evaluation, "time_s": self._clock.elapsed()})
                self._checkpoint_if_out()
            if self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
                self._checkpoint_if_out()
            if time_limit_s is not None and self.step < self.config.steps and self._time_is_up(start, time_limit_s):
                self.stopped_reason = "time_limit"
                self._log.append({"event": "stopped", "reason": "time_limit", **self._progress_fields()})
                self._checkpoint_if_out()
                break
        bar.close()
        self._verify_buffers()
        final = self._progress_fields()
        if eval_set is not None:
            final["final_eval"] = self._evaluate_with_callbacks(eval_set)
        self._log.append(final)
        self._checkpoint_if_out()
        return self.history

    def _progress_fields(self) -> dict[str, Any]:
        """Where the run stands: its step, epsilon spent and elapsed wall time (one total, no step's own time)."""
        return {"step": self.step, "epsilon": self.ledger.epsilon, "time_s": self._clock.elapsed()}

    def _checkpoint_if_out(self) -> None:
        """Write a checkpoint (with out_dir) unless one of this step was written already."""
        if self.out_dir is not None and self._checkpoint_step != self.step:
            self.save_checkpoint()

    def _probe_once(self, source: TrainData) -> None:
        """The DP-safety probe (privacy/dp_safety.py), once, before the model sees data, at the largest batch a forward
        takes; every per-sample gradient computation after it is guarded (privacy/buffer_guard.py), and each chunk
        shape probed for mixing the first time it runs (privacy/shape_probe.py)."""
        if self._buffer_guard is None:
            rows = min(self.config.physical_batch_size, len(source)) * self.config.aug_mult
            example = self._first_example(source, "the training data")
            set_once = check_dp_safe(self.model, example, rows)
            self._buffer_guard = BufferGuard(self.model, set_once, deferred=True)
            self._shape_probe = BatchShapeProbe(self.model, (rows, *example.shape[1:]))

    def _stop_signal(self) -> signal.Signals | None:
        """The signal that stops the run at this step boundary, if any: in a job, any rank's (one host-side exchange
        per step), so that every rank stops at the same step and writes the checkpoint together."""
        received = self._interrupt.requested
        agreed = self.dist.max_on_host(0 if received is None else int(received))
        return signal.Signals(agreed) if agreed else None

    def _interrupted(self, signum: signal.Signals) -> TrainingInterrupted:
        """The stop by Ctrl-C or SIGTERM, logged and (with out_dir) checkpointed, as the exception fit raises."""
        self.stopped_reason = "interrupted"
        self._log.append({"event": "stopped", "reason": "interrupted", **self._progress_fields()})
        if self.out_dir is None:
            return TrainingInterrupted(self.step, None, signum)
        self.save_checkpoint()
        return TrainingInterrupted(self.step, self.checkpoint_path(), signum)

    def _logs_epsilon(self, step: int) -> bool:
        """Whether step `step`'s record carries epsilon and is written at once (the loop's only waits)."""
        return step % self.config.epsilon_every == 0 or step == self.config.steps

    def _time_is_up(self, start: float, limit_s: float) -> bool:
        """Past the time limit. In a job all ranks stop together: rank 0's clock decides, at the steps that
        write their record (one broadcast there)."""
        if not self.dist.enabled:
            return time.perf_counter() - start >= limit_s
        return self._logs_epsilon(self.step) and self.dist.agree(time.perf_counter() - start >= limit_s, self.device)

    def _source(self, data: Any, what: str) -> TrainData:
        return data if isinstance(data, TrainData) else as_train_data(data, what, self.config.data_in_memory_bytes)

    def _first_example(self, source: TrainData, what: str) -> torch.Tensor:
        """Example 0 of `source`, normalised (its shape is all the DP-safety probes use)."""
        if len(source) == 0:
            raise ParameterError(f"{what} is empty")
        images = source.gather(torch.zeros(1, dtype=torch.long))[0]
        if images.dim() < 2:  # as check_images: one dimension per example at least; the probes need its shape
            raise InvalidDataError(f"{what} images must be a tensor (N, C, H, W), got shape {tuple(images.shape)}")
        check_images(images, what)
        example = self._normalize(images)
        check_model_input(self.model, example, (len(source), *images.shape[1:]), what)
        return example

    def _checked(self, source: TrainData, what: str) -> TrainData:
        """`source` checked (a streamed set: its examples as they are read) and, in memory, on the device."""
        if isinstance(source, StreamedData):
            source.num_classes = self._num_classes(self._first_example(source, what))
            return source
        self._check_data(source.images, source.labels, what)
        return source.to(self.device)

    def _num_classes(self, example: torch.Tensor) -> int:
        """The model's output width, from a copy run on zeros shaped like `example`: the model being trained sees
        no data outside DP-SGD steps (a forward may write its buffers)."""
        probe = copy.deepcopy(self.model).eval()
        with torch.no_grad():
            return probe(torch.zeros_like(example[:1], device=self.device)).shape[-1]

    def _verify_buffers(self) -> None:
        """Read the buffer guard's queued checks (a wait for the device) before anything leaves the trainer."""
        if self._buffer_guard is not None:
            self._buffer_guard.verify()

    def _evaluate_with_callbacks(self, data: TrainData) -> dict[str, float]:
        self._verify_buffers()
        metrics = self.evaluate(data)
        for callback in self.callbacks:
            callback.on_eval_end(self, metrics)
        return metrics

    def _check_data(self, images: torch.Tensor, labels: torch.Tensor, what: str) -> None:
        """Refuse non-finite images and labels that are not class indices of this model (inputs.py)."""
        check_images(images, what)
        if len(images) == 0:
            raise ParameterError(f"{what} is empty")
        check_labels(labels, len(images), self._num_classes(self._normalize(images[:1])), what)

    def evaluate(self, data: ImagesAndLabels | Any) -> dict[str, float]:
        """Metrics of the EMA weights (if any) on `data`, plus shift-averaged ones when test_shifts is set.

        In a job each rank scores its slice of `data` and the logits are all-gathered: every rank returns the
        metrics of the whole set (all ranks must call this together).
        """
        with self.ema.applied(self.model) if self.ema is not None else contextlib.nullcontext():
            return self._evaluate_model(data)

    def _evaluate_model(self, data: ImagesAndLabels | Any) -> dict[str, float]:
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


def _input_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model's inputs are given in: its first floating parameter's (float32 for a model without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; a host-to-GPU copy goes through pinned memory, so the host does not wait for it."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
