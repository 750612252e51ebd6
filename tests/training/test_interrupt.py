"""Ctrl-C during training: the step under way finishes, a checkpoint is written, and the run says how to resume."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from equiconvert.cli import EXIT_INTERRUPTED, main
from equiconvert.training.callbacks import Callback
from equiconvert.training.interrupt import TrainingInterrupted
from equiconvert.training.trainer import DPTrainer
from tests.support.tiny import linear_classifier, tiny_images
from tests.support.train_args import tiny_train_args


@pytest.fixture(autouse=True)
def default_sigint_handler():
    """Python's own SIGINT and SIGTERM handlers, as in a fresh process: DeferredInterrupt leaves any other handler in
    place (a user's or a framework's), and a test elsewhere in the session may have left one installed."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGINT, previous[0])
    signal.signal(signal.SIGTERM, previous[1])


OPTIONS = dict(noise_multiplier=1.0, target_epsilon=None, batch_size=8, steps=4, aug_mult=1, ema_decay=None)
OPTIONS.update(augment_padding=0, augment_flip=False, progress=False, insecure_seeded_noise=True)


class CtrlCAt(Callback):
    """Sends this process SIGINT (as Ctrl-C does) at the end of step `step`, inside the training loop."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, record) -> None:
        if record["step"] == self.step:
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.filterwarnings("ignore:insecure_seeded_noise")
def test_ctrl_c_stops_between_steps_with_a_checkpoint_that_resumes_to_the_same_end(tmp_path, capsys):
    """Ctrl-C used to raise KeyboardInterrupt wherever the step was, with a traceback and no checkpoint."""
    torch.manual_seed(0)
    trainer = DPTrainer(linear_classifier(), out_dir=tmp_path / "run", callbacks=[CtrlCAt(2)], **OPTIONS)
    with pytest.raises(TrainingInterrupted) as err:
        trainer.fit(tiny_images())
    assert str(err.value) == (
        f"training stopped by Ctrl-C after step 2; its checkpoint is {tmp_path / 'run' / 'checkpoint.pt'}: "
        "continue with fit(..., resume=True)"
    )
    assert trainer.step == 2 and trainer.stopped_reason == "interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's handler is back
    assert "Ctrl-C again to abort now" in capsys.readouterr().err

    torch.manual_seed(0)
    resumed = DPTrainer(linear_classifier(), out_dir=tmp_path / "run", **OPTIONS)
    resumed.fit(tiny_images(), resume=True)
    torch.manual_seed(0)
    whole = DPTrainer(linear_classifier(), **OPTIONS)
    whole.fit(tiny_images())
    assert resumed.step == 4
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        assert torch.equal(a, b)


SMALL_RUN = dict(steps=3, model="equiconvert:resnet9", model_kwargs="widths=4,8,8", group="none")


def _train_sent_after_step_1(out, monkeypatch, signum: signal.Signals) -> int:
    """`equiconvert train` of SMALL_RUN into `out`, this process sent `signum` at the end of its first step."""
    original = DPTrainer._train_step

    def step_then_signal(self, data):
        record = original(self, data)
        if self.step == 1:
            os.kill(os.getpid(), signum)
        return record

    monkeypatch.setattr(DPTrainer, "_train_step", step_then_signal)
    status = main(tiny_train_args(out, **SMALL_RUN))
    monkeypatch.undo()
    return status


def test_the_command_line_exits_130_with_one_line_saying_to_resume(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert _train_sent_after_step_1(out, monkeypatch, signal.SIGINT) == EXIT_INTERRUPTED == 130
    error = capsys.readouterr().err
    assert error.endswith(
        "interrupted: training stopped by Ctrl-C after step 1; run the same command with --resume to continue\n"
    )
    assert "Traceback" not in error and (out / "checkpoint.pt").exists() and not (out / "result.json").exists()
    assert main(tiny_train_args(out, "--resume", **SMALL_RUN)) == 0
    assert json.loads((out / "result.json").read_text())["steps"] == 3


def test_sigterm_stops_the_command_line_with_a_checkpoint_and_exits_143(tmp_path, capsys, monkeypatch):
    """SIGTERM (what schedulers send) used to end the process at once, losing every step since the last checkpoint."""
    out = tmp_path / "run"
    assert _train_sent_after_step_1(out, monkeypatch, signal.SIGTERM) == 128 + signal.SIGTERM == 143
    error = capsys.readouterr().err
    assert "SIGTERM: stopping after this step with a checkpoint" in error
    assert error.endswith(
        "interrupted: training stopped by SIGTERM after step 1; run the same command with --resume to continue\n"
    )
    assert "Traceback" not in error and (out / "checkpoint.pt").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the default action is back after the run
