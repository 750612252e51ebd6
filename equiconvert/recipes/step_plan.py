"""Fit a run's steps to a time budget: time a few DP-SGD steps of the model on random images of the run's shape,
then calibrate the noise for the steps that fit (run.plan_steps)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import nn

from ..training.callbacks import Callback
from ..training.dp_config import DPConfig
from ..training.trainer import DPTrainer


PROBE_STEPS = 3  # timed steps, after one untimed warm-up step
PLAN_SHARE = 0.8  # of the time budget the planned steps may take: a margin for steps slower than the probe's


def probe_seconds_per_step(
    model: nn.Module,
    image_shape: tuple[int, ...],
    num_classes: int,
    device: str | None,
    config: DPConfig,
    steps: int = PROBE_STEPS,
) -> float:
    """Seconds per DP-SGD step of a copy of `model` with the run's batch options on this machine, timed on random
    images of the run's shape (one batch of batch_size examples a step; no data of the run is read)."""
    import copy

    batch = config.batch_size
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch, *image_shape), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, num_classes, (batch,), generator=generator)
    timing = dataclasses.replace(
        config,
        steps=steps + 1,
        target_epsilon=None,
        noise_multiplier=1.0,
        eval_every=None,
        checkpoint_every=None,
        epsilon_every=1,
        delta=None,
        ema_decay=None,
    )
    clock = _StepClock()
    trainer = DPTrainer(
        copy.deepcopy(model), device=device, out_dir=None, progress=False, callbacks=[clock], config=timing
    )
    trainer.fit((images, labels))
    return (clock.times[-1] - clock.times[0]) / steps


class _StepClock(Callback):
    """The time at the end of each step (the probe's epsilon_every=1 makes each step wait for the device)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_end(self, trainer: Any, record: dict[str, Any]) -> None:
        self.times.append(time.perf_counter())


def plan_steps(
    model: nn.Module,
    image_shape: tuple[int, ...],
    num_classes: int,
    device: str | None,
    config: DPConfig,
    time_budget_s: float,
) -> dict[str, Any]:
    """How many of the requested steps fit PLAN_SHARE of the time budget at the probe's pace (at least one); the
    noise is then calibrated for those steps, so the run spends its whole epsilon within the budget."""
    seconds = probe_seconds_per_step(model, image_shape, num_classes, device, config)
    requested = config.steps
    fitting = int(PLAN_SHARE * time_budget_s / seconds) if seconds > 0 else requested
    return {
        "probe_steps": PROBE_STEPS,
        "seconds_per_step": seconds,
        "time_budget_s": time_budget_s,
        "plan_share": PLAN_SHARE,
        "requested_steps": requested,
        "planned_steps": max(1, min(requested, fitting)),
    }
