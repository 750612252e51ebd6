"""The DP-SGD noise and sampling are secret: the noise-removal attack, the reproducible mode, checkpoints, logs."""

from __future__ import annotations

import json
import shutil
import stat

import pytest
import torch

from equiconvert.cli import main
from equiconvert.privacy.checkpoint import load
from equiconvert.privacy.per_sample import clip_and_sum, per_sample_gradients
from equiconvert.privacy.secure_rng import NOISE, SAMPLING, RandomSource
from equiconvert.privacy.trainer import DPTrainer
from tests.support.tiny import N, linear_classifier, tiny_images

SEED = 0
OPTIONS = dict(
    noise_multiplier=1.0,
    target_epsilon=None,
    batch_size=8,
    steps=1,
    aug_mult=1,
    lr=1.0,
    max_grad_norm=1.0,
    ema_decay=None,
    augment_padding=0,
    augment_flip=False,
    physical_batch_size=64,
    progress=False,
    seed=SEED,
)


def _attack(insecure: bool) -> float:
    """Train one step; rebuild the noise from the public seed and the initial weights, subtract it from the
    released update, and return the distance to the true sum of clipped gradients."""
    images, labels = tiny_images()
    torch.manual_seed(SEED)  # initial weights from the public seed, as `equiconvert train` does
    trainer = DPTrainer(linear_classifier(), insecure_seeded_noise=insecure, **OPTIONS)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer._prepare_privacy(N)
    drawn: list[torch.Tensor] = []
    sample = trainer.sampler.sample
    trainer.sampler.sample = lambda: drawn.append(sample()) or drawn[-1]
    trainer.fit((images, labels))
    released = dict(trainer.model.named_parameters())

    # the attacker: result.json's seed and the code give the noise generator; the weights give the update
    torch.manual_seed(SEED)
    rebuilt = dict(linear_classifier().named_parameters())
    source = RandomSource.seeded_from(SEED, NOISE)
    std = trainer.noise_multiplier * OPTIONS["max_grad_norm"]
    recovered = {
        n: (p.detach() - released[n].detach()) / OPTIONS["lr"] * OPTIONS["batch_size"] - source.gaussian(p.shape, std)
        for n, p in rebuilt.items()
    }

    chosen = drawn[0]
    views = trainer._normalize(images[chosen]).unsqueeze(1)
    grads, _ = per_sample_gradients(trainer.model, initial, {}, views, labels[chosen])
    truth, _ = clip_and_sum(grads, OPTIONS["max_grad_norm"])
    return max(float((recovered[n] - truth[n]).abs().max()) for n in truth)


def test_noise_removal_attack_succeeds_only_in_the_insecure_seeded_mode():
    with pytest.warns(UserWarning, match="NOT differentially private"):
        assert _attack(insecure=True) < 1e-4  # the noise-free sum of clipped gradients, recovered
    assert _attack(insecure=False) > 0.5  # the default: what is left is still noise of std sqrt(2) per entry


def test_default_noise_and_sampling_differ_between_runs_with_the_same_seed():
    first, second = (DPTrainer(linear_classifier(), **OPTIONS) for _ in range(2))
    assert first.private and second.private
    assert not torch.equal(first._noise_source.gaussian((64,), 1.0), second._noise_source.gaussian((64,), 1.0))
    assert not torch.equal(first._sampling_source.uniform(64), second._sampling_source.uniform(64))
    seeded = [RandomSource.seeded_from(3, SAMPLING).uniform(64) for _ in range(2)]
    assert torch.equal(*seeded)


def test_combined_samples_keep_their_distributions():
    source = RandomSource.seeded_from(0, NOISE)
    noise = source.gaussian((200_000,), 2.0)
    assert abs(float(noise.mean())) < 0.02 and abs(float(noise.std()) - 2.0) < 0.02
    uniform = source.uniform(200_000)
    assert float(uniform.min()) >= 0.0 and float(uniform.max()) < 1.0
    assert abs(float(uniform.mean()) - 0.5) < 0.005 and abs(float((uniform < 0.1).double().mean()) - 0.1) < 0.005


def test_secret_run_resumes_bit_identically_from_its_checkpoint(tmp_path):
    """Kill after step 2, resume from the copy of its checkpoint: the same weights as the run that went on."""
    images, labels = tiny_images()
    options = {**OPTIONS, "steps": 4, "checkpoint_every": 1}
    torch.manual_seed(SEED)
    initial = linear_classifier()
    going_on = DPTrainer(initial, out_dir=tmp_path / "a", **options)
    going_on._prepare_privacy(N)
    for _ in range(2):
        going_on.train_step(images, labels)
    going_on.save_checkpoint()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for _ in range(2):
        going_on.train_step(images, labels)
    torch.manual_seed(SEED)
    resumed = DPTrainer(linear_classifier(), out_dir=tmp_path / "b", **options)
    resumed.fit((images, labels), resume=True)
    assert resumed.step == 4
    for (name, a), b in zip(going_on.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_checkpoint_is_owner_only_and_holds_generator_states_as_uint8_tensors(tmp_path):
    trainer = DPTrainer(linear_classifier(), out_dir=tmp_path, checkpoint_every=1, **OPTIONS)
    trainer.fit(tiny_images())
    path = tmp_path / "checkpoint.pt"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    state = load(path)  # weights_only=True
    for generator_state in [*state["rng"]["noise"], *state["sampler"]["generator_states"]]:
        assert isinstance(generator_state, torch.Tensor) and generator_state.dtype == torch.uint8
    assert len(state["rng"]["noise"]) == len(state["sampler"]["generator_states"]) == 2
    assert "seed" not in state["sampler"]


def _train(tmp_path, *flags: str) -> tuple[dict, list[dict]]:
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--dataset",
                "synthetic",
                "--model",
                "equiconvert:resnet9",
                "--model-kwargs",
                "widths=4,8,8",
                "--group",
                "none",
                "--steps",
                "2",
                "--batch-size",
                "8",
                "--aug-mult",
                "1",
                "--physical-batch-size",
                "8",
                "--out",
                str(out),
                "--set",
                "run.progress=false",
                "--device",
                "cpu",
                *flags,
            ]
        )
        == 0
    )
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return json.loads((out / "result.json").read_text()), log


def test_train_is_private_by_default_and_logs_no_noise_free_statistics(tmp_path, capsys):
    result, log = _train(tmp_path)
    assert result["private"] is True and result["log_nonprivate_stats"] is False
    assert result["nonfinite_gradients"] == 0
    steps = [record for record in log if "lr" in record]
    assert len(steps) == 2 and not any({"train_loss", "batch_size"} & set(record) for record in steps)
    text = json.dumps(result) + capsys.readouterr().out
    assert "generator" not in text and "secret" not in text


def test_insecure_and_nonprivate_options_are_recorded(tmp_path):
    with pytest.warns(UserWarning, match="NOT differentially private"):
        result, log = _train(tmp_path, "--insecure-seeded-noise", "--set", "dp.log_nonprivate_stats=true")
    assert result["private"] is False and result["log_nonprivate_stats"] is True
    steps = [record for record in log if "lr" in record]
    assert all({"train_loss", "batch_size"} <= set(record) for record in steps)
