"""Data-parallel DP-SGD (training/distributed.py): 2 gloo processes on CPU.

One job of 2 spawned processes (the `job` fixture) runs every distributed scenario once and saves what each
rank saw; the tests below check one property each on those records.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from equiconvert.privacy.shape_probe import BatchShapeProbe
from equiconvert.training.distributed import SINGLE_PROCESS, DistributedContext
from equiconvert.training.metrics import evaluate
from equiconvert.training.run_lock import LOCK_FILE, hold_run_folder
from equiconvert.privacy.checkpoint import load
from equiconvert.privacy.sampling import PoissonSampler
from equiconvert.privacy.secure_rng import SAMPLING, make_source
from equiconvert.training.trainer import DPTrainer
from tests.training.test_run_lock import _gone
from tests.support.paths import REPO_ROOT
from tests.support.rng import freshly_keyed
from tests.support.train_args import tiny_train_args

WORLD = 2
N, BATCH = 200, 50  # sampling scenario: q = 0.25
SAMPLING_STEPS = 400
SIGMA, CLIP = 1.5, 0.5  # noise scenario
NOISE_STEPS = 100


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    )


def _data(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=generator),
        torch.randint(0, 3, (n,), generator=generator),
    )


class _FixedSampler:
    """Stands in for the Poisson sampler: the same given indices at every step."""

    def __init__(self, indices: torch.Tensor, sample_rate: float) -> None:
        self.indices, self.sample_rate = indices, sample_rate

    def sample(self) -> torch.Tensor:
        return self.indices


def _trainer(context: DistributedContext, out_dir: Path | None = None, **options) -> DPTrainer:
    settings = {
        "target_epsilon": 8.0,
        "batch_size": 16,
        "steps": 4,
        "aug_mult": 2,
        "lr": 0.5,
        "momentum": 0.9,
        "physical_batch_size": 8,
        "ema_decay": 0.99,
        "epsilon_every": 1,
        "checkpoint_every": 1,
        "eval_batch_size": 7,
        # runs compared with each other need the same noise; the log test reads the batch sizes
        "insecure_seeded_noise": True,
        "log_nonprivate_stats": True,
    }
    settings.update(options)
    return DPTrainer(_model(), device="cpu", out_dir=out_dir, progress=False, distributed=context, **settings)


def _states(trainer: DPTrainer) -> dict:
    return {
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "ema": trainer.ema.state_dict(),
        "ledger": trainer.ledger.state_dict(),
        "step": trainer.step,
        "sampler": trainer.sampler.state_dict(),
    }


def _worker(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    root_path = Path(root)
    dist.init_process_group("gloo", init_method=f"file://{root_path / 'rendezvous'}", rank=rank, world_size=WORLD)
    context = DistributedContext(WORLD, rank, rank)
    saved: dict = {}

    # sampling: this rank's batches at the global rate q
    sampler = PoissonSampler(N, BATCH, make_source(SAMPLING, None), shard=context.shard())
    saved["sample_rate"] = sampler.sample_rate
    saved["batches"] = [sampler.sample() for _ in range(SAMPLING_STEPS)]

    # clipped-gradient sum: the job on fixed examples split between the ranks vs one process on all of them
    data = _data()
    chosen = torch.tensor([0, 3, 4, 9, 10, 17, 22, 23, 30, 41, 42, 55])
    torch.manual_seed(5)
    job = _trainer(context, noise_multiplier=1e-6, target_epsilon=None, aug_mult=1)
    job._prepare_privacy(len(data[0]))
    job.sampler = _FixedSampler(chosen[chosen % WORLD == rank], job.sampler.sample_rate)
    saved["job_gradient"], saved["job_batch"], _, _ = job._noisy_gradient(*data)
    if rank == 0:
        torch.manual_seed(5)
        single = _trainer(SINGLE_PROCESS, noise_multiplier=1e-6, target_epsilon=None, aug_mult=1)
        single._prepare_privacy(len(data[0]))
        single.sampler = _FixedSampler(chosen, single.sampler.sample_rate)
        saved["single_gradient"], saved["single_batch"], _, _ = single._noisy_gradient(*data)

    # noise: empty batches on both ranks, so the reduced gradient is the job's noise alone
    noisy = _trainer(context, noise_multiplier=SIGMA, target_epsilon=None, max_grad_norm=CLIP, batch_size=8)
    noisy._prepare_privacy(len(data[0]))
    noisy.sampler = _FixedSampler(torch.empty(0, dtype=torch.long), noisy.sampler.sample_rate)
    saved["noise"] = [
        torch.cat([g.flatten() for g in noisy._noisy_gradient(*data)[0].values()]) * 8 for _ in range(NOISE_STEPS)
    ]

    # a training run, uninterrupted, and the same run stopped after its first step and resumed
    eval_set = _data(21, seed=1)
    torch.manual_seed(0)
    straight = _trainer(context, root_path / "straight")
    straight.fit(data, eval_set=eval_set)
    saved["straight"] = _states(straight)
    saved["straight_eval"] = straight.history[-1]["final_eval"]
    with straight.ema.applied(straight.model):
        saved["local_eval"] = evaluate(straight.model, *eval_set, 7, "cpu", straight._normalize)
    torch.manual_seed(0)
    stopped = _trainer(context, root_path / "resumed")
    stopped.fit(data, time_limit_s=0.0)
    saved["stopped"] = (stopped.step, stopped.stopped_reason)
    torch.manual_seed(1)  # other initial weights: the resumed run must take everything from the checkpoint
    resumed = _trainer(context, root_path / "resumed")
    resumed.fit(data, eval_set=eval_set, resume=True)
    saved["resumed"] = _states(resumed)

    # a private run: the checkpoint holds every rank's generators re-keyed at the save
    torch.manual_seed(0)
    _trainer(context, root_path / "private", steps=2, insecure_seeded_noise=False, log_nonprivate_stats=False).fit(data)
    torch.save(saved, root_path / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("job")
    mp.spawn(_worker, args=(str(root),), nprocs=WORLD, join=True)
    return root, [torch.load(root / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]


def test_ranks_sample_disjoint_shards_at_the_global_rate(job):
    _, ranks = job
    assert all(saved["sample_rate"] == BATCH / N for saved in ranks)
    counts = torch.zeros(N)
    for step in range(SAMPLING_STEPS):
        union = torch.cat([saved["batches"][step] for saved in ranks])
        assert len(union.unique()) == len(union)  # no example twice in a step
        counts[union] += 1
    q = BATCH / N
    mean, std = SAMPLING_STEPS * q, math.sqrt(SAMPLING_STEPS * q * (1 - q))
    assert abs(counts.mean() - mean) < 5 * std / math.sqrt(N)  # the rate over all examples
    assert (counts - mean).abs().max() < 5 * std  # and every example joins at that rate (none left out)
    per_rank = [torch.cat(saved["batches"]) for saved in ranks]
    assert all(((batch % WORLD) == rank).all() for rank, batch in enumerate(per_rank))


def test_clipped_gradient_sum_of_two_processes_equals_one_process(job):
    _, ranks = job
    single = ranks[0]["single_gradient"]
    assert int(ranks[0]["job_batch"]) == int(ranks[0]["single_batch"]) == 12
    for saved in ranks:
        for name, value in single.items():
            # sums (x batch_size) of clipped gradients of norm <= 2, noise 1e-6 * 2: equal to 1e-5
            assert torch.allclose(saved["job_gradient"][name] * 16, value * 16, atol=1e-5, rtol=0), name


def test_noise_enters_each_step_once_with_standard_deviation_sigma_c(job):
    _, ranks = job
    noise = torch.cat(ranks[0]["noise"])
    assert torch.equal(noise, torch.cat(ranks[1]["noise"]))  # both ranks apply the same noisy gradient
    ratio = float(noise.std()) / (SIGMA * CLIP)
    tolerance = 5 / math.sqrt(2 * noise.numel())
    assert abs(ratio - 1) < tolerance, ratio
    assert abs(ratio - math.sqrt(WORLD)) > 5 * tolerance and abs(ratio - 1 / math.sqrt(WORLD)) > 5 * tolerance


def _assert_equal(a, b, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_model_optimizer_ema_and_ledger_are_identical_on_every_rank(job):
    _, ranks = job
    for key in ("model", "optimizer", "ema", "ledger", "step"):
        _assert_equal(ranks[0]["straight"][key], ranks[1]["straight"][key], key)
    assert ranks[0]["straight"]["step"] == 4
    assert ranks[0]["straight"]["ledger"]["sample_rate"] == 16 / 64  # the accountant's q is the global rate


def test_stopped_two_process_run_resumes_exactly(job):
    _, ranks = job
    for saved in ranks:
        assert saved["stopped"] == (1, "time_limit")
        _assert_equal(saved["straight"], saved["resumed"])  # each rank's own sampler included


def test_only_rank_zero_writes_and_the_log_has_each_step_once(job):
    root, _ = job
    records = [json.loads(line) for line in (root / "straight" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "batch_size" in r] == [1, 2, 3, 4]
    assert all(
        isinstance(r["train_loss"], float) and isinstance(r["batch_size"], int) for r in records if "batch_size" in r
    )
    state = torch.load(root / "straight" / "checkpoint.pt", weights_only=True)
    assert state["world_size"] == WORLD and len(state["other_ranks"]) == WORLD - 1
    assert state["other_ranks"][0]["sampler"]["shard"] == (1, WORLD)


def test_a_private_checkpoint_holds_only_freshly_keyed_generators_of_every_rank(job):
    """Forward security on every rank: no stored state (noise, sampling of its shard, augmentation, torch's global
    generator) derives a draw made before the save."""
    root, _ = job
    state = torch.load(root / "private" / "checkpoint.pt", weights_only=True)
    assert len(state["other_ranks"]) == WORLD - 1
    for rank in [state, *state["other_ranks"]]:
        rng = rank["rng"]
        states = [*rng["noise"], *rank["sampler"]["generator_states"], rng["augment"], rng["torch"]]
        assert len(states) == 6 and all(freshly_keyed(s) for s in states)


def test_sharded_evaluation_reports_the_whole_set(job):
    _, ranks = job
    for saved in ranks:
        assert saved["straight_eval"] == pytest.approx(ranks[0]["local_eval"], abs=1e-6)


def test_resume_on_another_world_size_is_refused_naming_both(job):
    root, _ = job
    trainer = _trainer(SINGLE_PROCESS, root / "straight")
    with pytest.raises(ValueError, match=r"job of 2 process\(es\); this job has 1"):
        trainer.fit(_data(), resume=True)


def _sync_calls(monkeypatch, steps: int) -> int:
    """Calls that copy a tensor to the host (wait for the device) during a fit of `steps` steps, outside the
    cross-example probe of a new chunk shape (once per shape, not per step: privacy/shape_probe.py)."""
    calls, probing = [0], [False]
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            calls[0] += 0 if probing[0] else 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    check = BatchShapeProbe.check

    def uncounted_check(self, inputs):
        probing[0] = True
        try:
            return check(self, inputs)
        finally:
            probing[0] = False

    monkeypatch.setattr(BatchShapeProbe, "check", uncounted_check)
    trainer = _trainer(SINGLE_PROCESS, steps=steps, epsilon_every=steps, checkpoint_every=None)
    trainer.fit(_data())
    monkeypatch.undo()
    return calls[0]


def test_training_loop_waits_for_the_device_only_at_log_steps(monkeypatch):
    assert _sync_calls(monkeypatch, 6) == _sync_calls(monkeypatch, 2)


def test_nproc_per_node_launches_workers_through_torchrun(tmp_path):
    out = tmp_path / "run"
    train = tiny_train_args(
        out,
        nproc_per_node=2,
        model="equiconvert:resnet9",
        model_kwargs="widths=4,8,8",
        group="none",
        steps=2,
        batch_size=16,
        physical_batch_size=16,
    )
    command = [sys.executable, "-m", "equiconvert", *train]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(_scratch(tmp_path))}
    finished = subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2 and result["steps"] == 2
    assert finished.stdout.count('"world_size": 2') == 1  # one printout per job
    assert _worker_log_folders(tmp_path) == []  # the job removed its /tmp/equiconvert-workers-* folder


def _scratch(tmp_path: Path) -> Path:
    """The temporary folder (TMPDIR) of a launched job, where its workers' log folder goes."""
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    return scratch


def _worker_log_folders(tmp_path: Path) -> list[Path]:
    return list(_scratch(tmp_path).glob("equiconvert-workers-*"))


def test_a_sampler_state_of_another_shard_is_refused():
    other = PoissonSampler(N, BATCH, make_source(SAMPLING, None), shard=(1, WORLD)).state_dict()
    with pytest.raises(ValueError, match=r"shard \(rank, world_size\) \(1, 2\)"):
        PoissonSampler(N, BATCH, make_source(SAMPLING, None), shard=(0, WORLD)).load_state_dict(other)


def test_a_job_refuses_one_card_for_all_ranks(monkeypatch):
    from equiconvert.training.distributed import from_environment

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="device=cuda:1: in a job of 2 processes give device=cuda"):
        from_environment("cuda:1")


def _children(pid: int) -> list[int]:
    """The processes `pid` started that are still its children (Linux /proc)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for task in tasks.iterdir() for c in (task / "children").read_text().split()]


def _training_job(out: Path, stderr: int) -> tuple[subprocess.Popen, int]:
    """A `train --nproc-per-node 2` launcher of a long tiny run, once rank 0 holds OUT's lock, and rank 0's pid."""
    train = tiny_train_args(out, nproc_per_node=2, steps=100000, batch_size=16, physical_batch_size=16)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "equiconvert", *train], env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True
    )
    lock, deadline = out / LOCK_FILE, time.monotonic() + 240
    while not (lock.exists() and lock.read_text()) and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # until rank 0 holds OUT's lock: both workers run
    return launcher, int(lock.read_text())


def test_a_launcher_killed_with_sigkill_takes_its_workers_and_the_lock_with_it(tmp_path):
    out = tmp_path / "run"
    launcher, rank_zero = _training_job(out, subprocess.DEVNULL)
    workers = _children(launcher.pid)
    launcher.kill()
    launcher.wait()
    assert len(workers) == 2 and rank_zero in workers
    # a worker past its start dies with the launcher at once; one still importing torch on a busy machine ends
    # when it reaches the check of its launcher's pid, which may take a while
    survivors = [pid for pid in workers if not _gone(pid, within_s=120)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "workers outlived their launcher"
    with hold_run_folder(out):  # the dead job holds the folder no more
        pass


def test_a_worker_killed_mid_run_is_one_line_naming_it_and_its_log(tmp_path):
    """A dead worker used to show as gloo's traceback ("Connection closed by peer") from the others, then torchrun's."""
    launcher, rank_zero = _training_job(tmp_path / "run", subprocess.PIPE)
    time.sleep(2)  # into the training loop's collectives
    os.kill(next(pid for pid in _children(launcher.pid) if pid != rank_zero), signal.SIGKILL)
    stderr = launcher.communicate(timeout=120)[1]
    assert launcher.returncode == 6  # a run error (equiconvert.cli.common.EXIT_CODES)
    lines = stderr.strip().splitlines()
    assert re.fullmatch(r"error: worker 1 died \(signal SIGKILL\), see /\S+/attempt_0/1/stderr\.log", lines[-1])
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr, stderr[-3000:]


def test_ctrl_c_of_a_job_stops_every_worker_at_one_step_with_a_checkpoint(tmp_path):
    """Ctrl-C of a `--nproc-per-node` job used to end every worker inside its step, with tracebacks and no checkpoint."""
    out = tmp_path / "run"
    train = tiny_train_args(
        out, "--set", "schedule.epsilon_every=1", nproc_per_node=2, steps=100000, batch_size=16, physical_batch_size=16
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(_scratch(tmp_path))}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "equiconvert", *train],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log, deadline = out / "log.jsonl", time.monotonic() + 240
    while not log.exists() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # until rank 0 wrote its first step's record: both workers are in the training loop
    launcher.send_signal(signal.SIGINT)  # what Ctrl-C sends the launcher (torchrun passes it on to the workers)
    stderr = launcher.communicate(timeout=240)[1]
    assert launcher.returncode == 130, stderr[-3000:]
    assert re.fullmatch(
        r"interrupted: training stopped by Ctrl-C after step (\d+); run the same command with --resume to continue",
        stderr.strip().splitlines()[-1],
    ), stderr[-3000:]
    assert "Traceback" not in stderr and "death signal" not in stderr, stderr[-3000:]
    stopped = json.loads(log.read_text().splitlines()[-1])
    assert stopped["event"] == "stopped" and stopped["reason"] == "interrupted"
    saved = load(out / "checkpoint.pt")
    assert saved["step"] == stopped["step"] >= 1 and saved["world_size"] == 2
    assert _worker_log_folders(tmp_path) == []
