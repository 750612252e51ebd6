"""The DP-SGD noise and sampling are secret: the noise-removal attack, the reproducible mode, checkpoints, logs."""

from __future__ import annotations

import json
import math
import secrets
import stat

import pytest
import torch

from equiconvert.cli import main
from equiconvert.privacy.checkpoint import load
from equiconvert.privacy.dp_step import clip_and_sum
from equiconvert.privacy.per_sample import per_sample_gradients
from equiconvert.privacy.secure_rng import NOISE, SAMPLING, RandomSource
from equiconvert.training.trainer import DPTrainer
from tests.support.crash import CopyOutAfter
from tests.support.tiny import N, linear_classifier, tiny_images
from tests.support.train_args import tiny_train_args

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
    assert not torch.equal(
        first._sampling_source.bernoulli_mask(256, 0.5), second._sampling_source.bernoulli_mask(256, 0.5)
    )
    seeded = [RandomSource.seeded_from(3, SAMPLING).bernoulli_mask(256, 0.5) for _ in range(2)]
    assert torch.equal(*seeded)


# --------------------------------------------------------------------------- the combined draws
DRAWS = 200_000
Z = 5.0  # bounds at 5 standard errors: a correct sampler fails them with probability < 1e-6


@pytest.mark.parametrize("q", [0.5, 0.1, 0.003, 2**-10])
def test_bernoulli_inclusion_rate_is_q_within_a_binomial_bound(q):
    mask = RandomSource.seeded_from(7, SAMPLING).bernoulli_mask(DRAWS, q)
    assert mask.dtype == torch.bool and mask.shape == (DRAWS,)
    bound = Z * math.sqrt(DRAWS * q * (1 - q))
    assert abs(int(mask.sum()) - DRAWS * q) < bound


def test_bernoulli_edge_rates_and_a_rate_outside_zero_one_is_refused():
    source = RandomSource.seeded_from(0, SAMPLING)
    assert bool(source.bernoulli_mask(1000, 1.0).all()) and not bool(source.bernoulli_mask(1000, 0.0).any())
    with pytest.raises(ValueError, match="sampling probability"):
        source.bernoulli_mask(10, 1.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_noise_std_is_the_requested_std_within_a_chi_square_bound(dtype):
    std = 2.5
    noise = RandomSource.seeded_from(0, NOISE).gaussian((DRAWS,), std, dtype=dtype)
    assert noise.dtype == dtype
    # sum((x / std)^2) ~ chi-square(n): mean n, variance 2n
    chi2 = float((noise.double() / std).pow(2).sum())
    assert abs(chi2 - DRAWS) < Z * math.sqrt(2 * DRAWS)
    assert abs(float(noise.double().mean())) < Z * std / math.sqrt(DRAWS)


def test_two_secret_sources_differ_and_a_seeded_one_reproduces():
    first, second = RandomSource.secret(), RandomSource.secret()
    assert first.private and second.private
    assert not torch.equal(first.gaussian((64,), 1.0), second.gaussian((64,), 1.0))
    assert not torch.equal(first.bernoulli_mask(256, 0.5), second.bernoulli_mask(256, 0.5))
    for purpose in (NOISE, SAMPLING):
        a, b = RandomSource.seeded_from(11, purpose), RandomSource.seeded_from(11, purpose)
        assert not a.private
        assert torch.equal(a.gaussian((64,), 1.0), b.gaussian((64,), 1.0))
        assert torch.equal(a.bernoulli_mask(256, 0.5), b.bernoulli_mask(256, 0.5))
    noise, sampling = RandomSource.seeded_from(11, NOISE), RandomSource.seeded_from(11, SAMPLING)
    assert not torch.equal(noise.gaussian((64,), 1.0), sampling.gaussian((64,), 1.0))  # purposes never share streams


@pytest.mark.parametrize("known", [0, 1])
def test_knowing_one_generators_seed_does_not_reproduce_the_draws(known):
    """The attacker knows generator `known`'s seed; the other one's is secret: the draws stay unpredictable."""

    def with_known_seed() -> RandomSource:
        seeds = [secrets.randbits(64), secrets.randbits(64)]
        seeds[known] = 1234
        return RandomSource(seeds)

    first, second = with_known_seed(), with_known_seed()
    assert not torch.equal(first.gaussian((64,), 1.0), second.gaussian((64,), 1.0))
    assert not torch.equal(first.bernoulli_mask(256, 0.5), second.bernoulli_mask(256, 0.5))
    # nor does the known generator's own stream predict them
    alone = torch.Generator().manual_seed(1234)
    assert not torch.equal(with_known_seed().gaussian((64,), 1.0), torch.randn(64, generator=alone))
    alone = torch.Generator().manual_seed(1234)
    guess = torch.randint(0, 2**53, (256,), generator=alone, dtype=torch.int64) < 2**52
    assert not torch.equal(with_known_seed().bernoulli_mask(256, 0.5), guess)


def test_a_saved_generator_state_list_loads_and_continues_both_streams():
    """A checkpoint holds each source as a list of two torch generator states (uint8); loading one continues the
    generators where they were, so every state written by a DPTrainer checkpoint resumes."""
    generators = [torch.Generator().manual_seed(s) for s in (5, 6)]
    saved = [g.get_state() for g in generators]
    source = RandomSource.secret()
    source.load_state_dict(saved)
    r1, r2 = (torch.randint(0, 2**53, (100,), generator=g, dtype=torch.int64) for g in generators)
    assert torch.equal(source.bernoulli_mask(100, 0.3), torch.bitwise_xor(r1, r2) < math.floor(0.3 * 2**53))
    assert source.state_dict()[0].dtype == torch.uint8
    with pytest.raises(ValueError, match="list of 2 generator states"):
        source.load_state_dict(saved[:1])


def test_secret_run_resumes_bit_identically_from_its_checkpoint(tmp_path):
    """Kill after step 2, resume from the copy of its checkpoint: up to the next checkpoint, the same weights as
    the run that went on (it continued from the re-keyed states it wrote; each later save re-keys afresh)."""
    images, labels = tiny_images()
    options = {**OPTIONS, "steps": 4, "checkpoint_every": 2}
    torch.manual_seed(SEED)
    copy_out = CopyOutAfter(3, tmp_path / "a", tmp_path / "b")
    going_on = DPTrainer(linear_classifier(), out_dir=tmp_path / "a", callbacks=[copy_out], **options)
    going_on.fit((images, labels))
    assert load(tmp_path / "b" / "checkpoint.pt")["step"] == 2
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
    args = tiny_train_args(out, *flags, model="equiconvert:resnet9", model_kwargs="widths=4,8,8", group="none", steps=2)
    assert main(args) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return json.loads((out / "result.json").read_text()), log


def test_default_train_is_private_logs_no_step_statistics_or_times_and_writes_an_owner_only_checkpoint(
    tmp_path, capsys
):
    result, log = _train(tmp_path)
    assert result["private"] is True and result["log_nonprivate_stats"] is False
    assert result["log_step_times"] is False
    assert "nonfinite_gradients" not in result  # a noise-free count of training examples
    steps = [record for record in log if "lr" in record]
    assert len(steps) == 2 and not any({"train_loss", "batch_size", "time_s"} & set(record) for record in steps)
    checkpoint = tmp_path / "run" / "checkpoint.pt"  # the README's resumable checkpoint, written by default
    assert stat.S_IMODE(checkpoint.stat().st_mode) == 0o600 and load(checkpoint)["step"] == 2
    text = json.dumps(result) + capsys.readouterr().out
    assert "generator" not in text and "secret" not in text


def test_insecure_and_nonprivate_options_are_recorded(tmp_path):
    with pytest.warns(UserWarning, match="NOT differentially private"):
        result, log = _train(tmp_path, "--insecure-seeded-noise", "--set", "dp.log_nonprivate_stats=true")
    assert result["private"] is False and result["log_nonprivate_stats"] is True
    steps = [record for record in log if "lr" in record]
    assert all({"train_loss", "batch_size"} <= set(record) for record in steps)
    assert result["nonfinite_gradients"] == 0


@pytest.mark.parametrize("bit", [0, 31, 40, 63, 64, 127])
def test_attack_every_one_of_128_key_bits_of_a_cpu_generator_changes_the_secret_draws(bit, monkeypatch):
    """The attack: a CPU generator seeded with 64 bits keeps the low 32 (torch's MT19937), so brute-forcing 2 x 32
    bits rebuilt a purpose's noise. Each generator is keyed with 128 bits now, all of which reach its state: two
    keys that differ in any one bit give other draws, so no bit of the key can be left out of a search."""
    secret_value = int.from_bytes(bytes(range(1, 17)), "little")

    def source_with(value: int) -> RandomSource:
        # the CSPRNG, pinned: `value` for the first stream, its complement for the second (old code asked for 64
        # random bits, the new asks for 16 random bytes)
        draws = iter([value, value ^ (2**128 - 1)])
        monkeypatch.setattr(secrets, "randbits", lambda bits: next(draws) % 2**bits)
        monkeypatch.setattr(secrets, "token_bytes", lambda count: next(draws).to_bytes(16, "little")[:count])
        return RandomSource.secret()

    same = source_with(secret_value), source_with(secret_value)
    assert torch.equal(same[0].gaussian((64,), 1.0), same[1].gaussian((64,), 1.0))  # the key alone decides
    flipped = source_with(secret_value ^ (1 << bit))
    assert not torch.equal(source_with(secret_value).gaussian((64,), 1.0), flipped.gaussian((64,), 1.0))
    assert not torch.equal(source_with(secret_value).bernoulli_mask(256, 0.5), flipped.bernoulli_mask(256, 0.5))


def test_a_keyed_cpu_generator_is_mt19937_from_624_words_of_shake256_of_its_key():
    """The keyed state is exactly MT19937's (numpy's reference generator, given the same 624 words, draws the same
    32-bit outputs: torch's 64-bit draws are its second and fourth words)."""
    import hashlib

    import numpy as np

    from equiconvert.privacy.secure_rng import key_generator

    key = bytes(range(16))
    generator = torch.Generator()
    key_generator(generator, key)
    words = np.frombuffer(hashlib.shake_256(b"equiconvert:generator-key:" + key).digest(4 * 624), dtype=np.uint32)
    reference = np.random.MT19937()
    reference.state = {"bit_generator": "MT19937", "state": {"key": words, "pos": 624}}
    drawn = torch.empty(4, dtype=torch.int64).random_(0, 2**32, generator=generator)
    assert drawn.tolist() == reference.random_raw(8)[1::2].tolist()
