"""A finished run's result.json record: its settings as they were used, its metrics and where it ran."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..privacy.filter_gradients import fastest_choices
from ..training.trainer import DPTrainer


def final_ema_decay(trainer: DPTrainer) -> float | None:
    """The decay the EMA's last update used (the warm-up may keep it under the one asked for); None without one."""
    return trainer.ema.decay_at(trainer.step - 1) if trainer.ema is not None and trainer.step else None


def eval_history(log: Path | None) -> list[dict[str, Any]]:
    """Every periodic evaluation of the run, from its log (which a resumed run appends to); none without a log.

    Only the process that writes the log reads it: another rank could read a line rank 0 is still writing.
    """
    records = [json.loads(line) for line in log.read_text().splitlines()] if log is not None and log.exists() else []
    by_step = {r["step"]: {"step": r["step"], **r["eval"]} for r in records if "eval" in r}
    return [by_step[step] for step in sorted(by_step)]


def device_name(device: torch.device) -> str:
    """'cuda (NVIDIA H200)' rather than 'cuda', so results say which card produced them."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


_RESULT_METRIC_NAMES = {"accuracy": "test_accuracy", "loss": "test_loss", "brier": "brier", "ece": "ece"}


def final_metrics(final: dict[str, float]) -> dict[str, float]:
    """The final evaluation under result.json's names; shift-averaged ones (DPConfig.test_shifts) get a suffix."""
    plain = {name: final[key] for key, name in _RESULT_METRIC_NAMES.items()}
    averaged = {
        f"{name}_shift_averaged": final[f"shift_averaged_{key}"]
        for key, name in _RESULT_METRIC_NAMES.items()
        if f"shift_averaged_{key}" in final
    }
    return {**plain, **averaged}


def trainer_record(trainer: DPTrainer, log: Path | None) -> dict[str, Any]:
    """A finished DPTrainer run's metrics, privacy spent and settings as used, under result.json's names.

    The count of examples with non-finite gradients is a noise-free statistic of the training data: it is in the
    record only when the run logs such statistics (DPConfig.log_nonprivate_stats).
    """
    c = trainer.config
    record = {
        **final_metrics(trainer.history[-1]["final_eval"]),
        "private": trainer.private,
        "log_nonprivate_stats": c.log_nonprivate_stats,
        "log_step_times": c.log_step_times,
        "epsilon": trainer.epsilon,
        "delta": trainer.delta,
        "target_epsilon": c.target_epsilon,
        "accountant": c.accountant,
        "noise_multiplier": trainer.noise_multiplier,
        "steps": trainer.step,
        "batch_size": c.batch_size,
        "aug_mult": c.aug_mult,
        "max_grad_norm": c.max_grad_norm,
        "lr": c.lr,
        "ema_decay": c.ema_decay,
        "ema_final_decay": final_ema_decay(trainer),
        "device": device_name(trainer.device),
        "lr_schedule": c.lr_schedule,
        "per_sample_method": trainer.per_sample_method,
        "precision": c.precision,
        "seed": c.seed,
        "filter_gradients": c.filter_gradients,
        "filter_gradient_kernels": fastest_choices(),  # what "fastest" chose in this process (one run per `train`)
        "requested_steps": c.steps,
        "stopped_reason": trainer.stopped_reason,
        "normalize_mean": c.normalize_mean,
        "normalize_std": c.normalize_std,
        "augment_padding": c.augment_padding,
        "augment_flip": c.augment_flip,
        "test_shifts": c.test_shifts,
        "evals": eval_history(log),
        # the run's, the stopped runs it resumes included
        "train_time_s": max((r["time_s"] for r in trainer.history if "time_s" in r), default=0.0),
    }
    if c.log_nonprivate_stats:
        record["nonfinite_gradients"] = trainer.nonfinite_gradients
    return record
