"""Checkpoints are forward-secure: from one, nobody replays an earlier step's noise or Poisson batch.

The attack: a torch generator's state begins with its seed, so a checkpoint holding the noise and sampling
generators of a run lets its holder reseed them, replay step 1's noise, subtract it from step 1's weight change
and read off the noise-free sum of clipped gradients, and replay step 1's Poisson batch.
"""

from __future__ import annotations

import copy
import json
import math
import pickle
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from equiconvert.privacy.checkpoint import load, save_atomic
from equiconvert.training.dp_config import DPConfig
from equiconvert.privacy.dp_step import clip_and_sum
from equiconvert.privacy.per_sample import per_sample_gradients
from equiconvert.privacy.secure_rng import RandomSource
from equiconvert.training.trainer import DPTrainer
from equiconvert.training.trainer_checkpoint import resume_identity
from tests.support.crash import CopyOutAfter
from tests.support.rng import freshly_keyed, initial_seed
from tests.support.tiny import N, linear_classifier, tiny_images

OPTIONS = dict(
    noise_multiplier=1.0,
    target_epsilon=None,
    batch_size=8,
    aug_mult=1,
    lr=1.0,
    max_grad_norm=1.0,
    ema_decay=None,
    augment_padding=1,  # the augmentation draws per example: its generator's position counts the batch sizes
    augment_flip=True,
    physical_batch_size=64,
    progress=False,
    epsilon_every=1,
)


def _replay_step_one(private: bool, tmp_path: Path) -> tuple[float, bool]:
    """Train 2 steps and checkpoint; from the checkpoint's generator states, replay step 1's noise and batch.

    Returns the largest distance between the recovered and the true noise-free sum of clipped gradients of step
    1, and whether the replayed Poisson batch of step 1 is the one drawn."""
    images, labels = tiny_images()
    options = {**OPTIONS, "augment_padding": 0, "augment_flip": False}  # step 1's views are its images
    trainer = DPTrainer(linear_classifier(), out_dir=tmp_path, steps=2, insecure_seeded_noise=not private, **options)
    trainer._prepare_privacy(N)
    drawn: list[torch.Tensor] = []
    sample = trainer.sampler.sample
    trainer.sampler.sample = lambda: drawn.append(sample()) or drawn[-1]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step(images, labels)
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train_step(images, labels)
    trainer.save_checkpoint()

    state = load(tmp_path / "checkpoint.pt")  # the attacker holds the file and the weights of steps 0 and 1
    noise = RandomSource([initial_seed(s) for s in state["rng"]["noise"]])
    sampling = RandomSource([initial_seed(s) for s in state["sampler"]["generator_states"]])
    std = state["noise_multiplier"] * OPTIONS["max_grad_norm"]
    recovered = {
        n: (before[n] - after[n]) / OPTIONS["lr"] * OPTIONS["batch_size"] - noise.gaussian(p.shape, std)
        for n, p in before.items()
    }
    replayed_batch = torch.arange(N)[sampling.bernoulli_mask(N, OPTIONS["batch_size"] / N)]

    chosen = drawn[0]
    views = trainer._normalize(images[chosen]).unsqueeze(1)
    grads, _ = per_sample_gradients(trainer.model, before, {}, views, labels[chosen])
    truth, _ = clip_and_sum(grads, OPTIONS["max_grad_norm"])
    error = max(float((recovered[n] - truth[n]).abs().max()) for n in truth)
    return error, torch.equal(replayed_batch, chosen)


def test_the_replay_attack_works_on_a_seeded_checkpoint(tmp_path):
    """The attack is sound: against the reproducible mode (whose states are not re-keyed) it recovers step 1."""
    with pytest.warns(UserWarning, match="NOT differentially private"):
        error, same_batch = _replay_step_one(private=False, tmp_path=tmp_path)
    assert error < 1e-4 and same_batch


def test_a_private_checkpoint_replays_no_earlier_noise_or_batch(tmp_path):
    error, same_batch = _replay_step_one(private=True, tmp_path=tmp_path)
    assert error > 0.1  # noise of std 1 per coordinate left in: nothing was subtracted
    assert not same_batch


def test_every_generator_state_in_a_private_checkpoint_is_freshly_keyed(tmp_path):
    """Noise, sampling, augmentation and torch's global generator: each state written derives only later draws
    (the augmentation's and the global one's positions would count the secret batch sizes)."""
    trainer = DPTrainer(linear_classifier(), out_dir=tmp_path, steps=3, checkpoint_every=3, **OPTIONS)
    trainer.fit(tiny_images())
    state = load(tmp_path / "checkpoint.pt")
    rng = state["rng"]
    states = [*rng["noise"], *state["sampler"]["generator_states"], rng["augment"], rng["torch"]]
    assert len(states) == 6 and all(freshly_keyed(s) for s in states)
    public = torch.Generator().manual_seed(1).get_state()  # the augmentation's, from the public seed 0
    assert not torch.equal(rng["augment"], public)


def test_a_resumed_secret_source_continues_the_live_one_and_draws_no_earlier_noise():
    """The live source and one loaded from its state draw the same from then on; neither the state nor its seeds
    give back the earlier draws, and the continued draws are N(0, std^2) (chi-square bound)."""
    live = RandomSource.secret()
    earlier = live.gaussian((4000,), 2.0)
    resumed = RandomSource.secret()
    resumed.load_state_dict(live.state_dict())
    later = resumed.gaussian((4000,), 2.0)
    assert torch.equal(later, live.gaussian((4000,), 2.0))
    reseeded = RandomSource([initial_seed(s) for s in resumed.state_dict()])  # after 1 save: fresh again
    assert not torch.equal(reseeded.gaussian((4000,), 2.0), earlier)
    assert abs(float(torch.corrcoef(torch.stack([earlier, later]))[0, 1])) < 5 / math.sqrt(4000)
    variance = float(later.double().pow(2).mean())
    assert abs(variance / 4.0 - 1) < 6 * math.sqrt(2 / 4000)


@pytest.mark.parametrize("duplicate", [pickle.loads, copy.deepcopy], ids=["pickle", "deepcopy"])
def test_a_pickled_or_copied_secret_source_replays_no_earlier_draw(duplicate):
    """make_private's optimizer and loader hold their sources: saving them whole is forward-secure too."""
    live = RandomSource.secret()
    earlier = live.gaussian((64,), 1.0)
    copied = duplicate(pickle.dumps(live)) if duplicate is pickle.loads else duplicate(live)
    assert all(freshly_keyed(g.get_state()) for g in copied._generators)  # as held, before any state_dict()
    assert torch.equal(copied.gaussian((64,), 1.0), live.gaussian((64,), 1.0))
    assert not torch.equal(copied.gaussian((64,), 1.0), earlier)


def test_seeded_mode_resumes_bit_exactly(tmp_path):
    """The reproducible mode is not re-keyed: a run stopped after step 1 and resumed ends with the weights of a
    run that never wrote a checkpoint."""
    options = {**OPTIONS, "steps": 4, "insecure_seeded_noise": True}
    with pytest.warns(UserWarning, match="NOT differentially private"):
        torch.manual_seed(0)
        never_stopped = DPTrainer(linear_classifier(), **options)
        never_stopped.fit(tiny_images())
        torch.manual_seed(0)
        stopped = DPTrainer(linear_classifier(), out_dir=tmp_path, **options)
        stopped.fit(tiny_images(), time_limit_s=0.0)
        torch.manual_seed(5)  # other initial weights: everything comes from the checkpoint
        resumed = DPTrainer(linear_classifier(), out_dir=tmp_path, **options)
        resumed.fit(tiny_images(), resume=True)
    assert stopped.step == 1 and resumed.step == 4
    for (name, a), b in zip(never_stopped.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def _log(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


def test_a_run_killed_after_its_checkpoint_resumes_with_each_step_logged_once_and_its_time_going_on(tmp_path):
    """Killed after step 4 with the checkpoint of step 2: the log holds steps 3 and 4 already; the resumed log
    has each step once, and its times go on from the checkpoint's elapsed time."""
    options = {**OPTIONS, "steps": 6, "checkpoint_every": 2}
    crashed = tmp_path / "b"
    kill_after_4 = CopyOutAfter(4, tmp_path / "a", crashed)
    DPTrainer(linear_classifier(), out_dir=tmp_path / "a", callbacks=[kill_after_4], **options).fit(tiny_images())
    assert [r["step"] for r in _log(crashed) if "lr" in r] == [1, 2, 3, 4]
    state = load(crashed / "checkpoint.pt")
    assert state["step"] == 2
    save_atomic({**state, "elapsed_s": 1000.0}, crashed / "checkpoint.pt")  # a run that had trained 1000 s
    resumed = DPTrainer(linear_classifier(), out_dir=crashed, **options)
    resumed.fit(tiny_images(), resume=True)
    log = _log(crashed)
    assert [r["step"] for r in log if "lr" in r] == [1, 2, 3, 4, 5, 6]
    timed = [r for r in log if r["step"] > 2 and "time_s" in r]
    assert timed and all(r["time_s"] >= 1000.0 for r in timed)
    assert load(crashed / "checkpoint.pt")["elapsed_s"] >= 1000.0


def test_how_often_checkpoints_are_written_may_change_on_resume():
    """checkpoint_every and log_step_times change what is written along the way, not what is trained."""
    saved = asdict(DPConfig(checkpoint_every=None))
    assert resume_identity(saved) == resume_identity(asdict(DPConfig(checkpoint_every=7, log_step_times=True)))
    assert resume_identity(saved) != resume_identity(asdict(DPConfig(steps=7)))


def test_step_times_are_logged_only_on_request_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="log_step_times.*NOT covered"):
        DPTrainer(linear_classifier(), out_dir=tmp_path, steps=2, log_step_times=True, **OPTIONS).fit(tiny_images())
    steps = [r for r in _log(tmp_path) if "lr" in r]
    assert len(steps) == 2 and steps[0]["time_s"] <= steps[1]["time_s"]


def test_the_default_log_has_no_step_time_only_run_totals(tmp_path):
    """A step's duration grows with its secret batch size: by default no step record carries a time."""
    images, labels = tiny_images()
    trainer = DPTrainer(linear_classifier(), out_dir=tmp_path, steps=4, eval_every=2, **OPTIONS)
    trainer.fit((images, labels), eval_set=(images, labels))
    log = _log(tmp_path)
    steps = [r for r in log if "lr" in r]
    assert len(steps) == 4 and not any("time" in key for r in steps for key in r)
    evaluations = [r for r in log if "eval" in r]
    assert [r["step"] for r in evaluations] == [2, 4] and all(r["time_s"] >= 0 for r in evaluations)
    assert log[-1]["time_s"] >= evaluations[-1]["time_s"]


def _step_durations_and_batch_sizes(folder: Path) -> tuple[list[float], list[float]]:
    steps = [r for r in _log(folder) if "lr" in r]
    times = [r.get("time_s") for r in steps]
    sizes = [float(r["batch_size"]) for r in steps]
    if any(t is None for t in times):
        return [], sizes
    return [b - a for a, b in zip([0.0, *times[:-1]], times)], sizes


class _WorkClock:
    """A stand-in for the wall clock that advances with the work done (rows through the trained model; not its
    copies, which the DP-safety probes run at each new batch shape), as a real one does where compute dominates:
    the attack's premise without the noise of a shared machine."""

    def __init__(self) -> None:
        self.rows = 0

    def model(self) -> torch.nn.Module:
        clock, model = self, linear_classifier()

        class Timed(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = model

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                if self is timed:
                    clock.rows += x.shape[0]
                return self.inner(x)

        timed = Timed()
        return timed

    def __call__(self) -> float:
        return float(self.rows)


def test_attack_step_times_reveal_the_secret_batch_sizes_only_when_asked_for(tmp_path, monkeypatch):
    """The attack on the former default log: a step's duration follows its Poisson batch size, so the logged step
    times recover the secret sizes. The default log gives the attacker no step time at all; the opt-in log still
    does, which is why it warns."""
    from equiconvert.training import run_log

    clock = _WorkClock()
    monkeypatch.setattr(run_log.time, "perf_counter", clock)
    images, labels = tiny_images()
    options = {**OPTIONS, "batch_size": N // 2, "log_nonprivate_stats": True, "steps": 12}  # sizes: ground truth
    with pytest.warns(UserWarning, match="guarantee"):
        opted_in = DPTrainer(clock.model(), out_dir=tmp_path / "opted_in", log_step_times=True, **options)
    opted_in.fit((images, labels))
    durations, sizes = _step_durations_and_batch_sizes(tmp_path / "opted_in")
    assert durations[1:] == pytest.approx(sizes[1:])  # the secret batch sizes, read off the log (step 1 also
    # holds the per-example method's one-off set-up)
    DPTrainer(clock.model(), out_dir=tmp_path / "default", **options).fit((images, labels))
    durations, sizes = _step_durations_and_batch_sizes(tmp_path / "default")
    assert durations == [] and len(sizes) == 12  # nothing to read: no step carries a time
