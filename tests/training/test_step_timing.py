"""What a DP-SGD run writes to stderr by default: the steps done and the epsilon spent, never a step's duration or
rate (which follow the secret Poisson batch sizes), and in a stream that is not a terminal, lines drawn at step
counts, never by the clock."""

from __future__ import annotations

import contextlib
import io
import re
import time

import pytest

from equiconvert import progress
from equiconvert.training.callbacks import Callback
from equiconvert.training.trainer import DPTrainer
from tests.support.tiny import linear_classifier, tiny_images

OPTIONS = dict(noise_multiplier=1.0, target_epsilon=None, batch_size=8, steps=6, aug_mult=1, ema_decay=None)
OPTIONS.update(augment_padding=0, augment_flip=False, epsilon_every=1)
TIMING = re.compile(r"\d+:\d\d|\d\s*(?:s/step|step/s|it/s|s/it)|\?(?:step|it)/s")  # [00:01<00:02, 3.1step/s]


class SlowEvenSteps(Callback):
    """Makes every second step slower, as a larger secret batch would."""

    def on_step_end(self, trainer, record) -> None:
        time.sleep(0.15 if trainer.step % 2 == 0 else 0.0)


def _stderr_of_a_run(**options) -> str:
    stream = io.StringIO()  # a file, as under nohup or a batch scheduler: not a terminal
    with contextlib.redirect_stderr(stream):
        DPTrainer(linear_classifier(), progress=True, callbacks=[SlowEvenSteps()], **{**OPTIONS, **options}).fit(
            tiny_images()
        )
    return stream.getvalue()


def test_attack_a_job_log_of_the_progress_bar_gives_no_step_time(monkeypatch):
    """The attack: read the progress bar a default run leaves in its job log and recover each step's duration from
    its rate or its clock. The bar (drawn at once here) shows steps and epsilon only, redrawn at every step, so the
    sequence of lines is the same whatever the steps took."""
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    text = _stderr_of_a_run()
    assert not TIMING.search(text), text
    lines = [line for line in re.split(r"[\r\n]+", text) if line.strip()]
    drawn = [int(re.search(r"(\d+)/6 steps", line).group(1)) for line in lines]
    assert sorted(set(drawn)) == list(range(7))  # every step drawn: which steps were drawn times nothing
    assert "eps=" in lines[-1]


def test_step_times_opted_in_still_leave_no_rate_in_a_stream_that_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    with pytest.warns(UserWarning, match="log_step_times"):
        text = _stderr_of_a_run(log_step_times=True)
    assert "6/6 steps" in text and not TIMING.search(text), text
