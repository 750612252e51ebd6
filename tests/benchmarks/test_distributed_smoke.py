"""benchmarks/distributed_smoke.py measures steady-state samples/s from the steps whose record waited for the device.

Samples are counted at the expected batch size: the actual Poisson batch sizes are secret and never logged.
"""

import json
import subprocess

import pytest

from tests.support.benchmark_scripts import load_benchmark


def _records(times: dict[int, float], batch: int | None = None) -> list[dict]:
    """Step records as `train` logs them (a batch size only where the run logs non-private statistics)."""
    return [
        {
            "step": step,
            "lr": 2.0,
            "time_s": time,
            **({"epsilon": 1.0} if step % 10 == 0 else {}),
            **({"batch_size": batch + step} if batch is not None else {}),
        }
        for step, time in times.items()
    ]


def test_throughput_spans_the_synced_steps_after_warmup_at_the_expected_batch():
    smoke = load_benchmark("distributed_smoke")
    times = {step: 0.5 * step + (5.0 if step >= 10 else 0.0) for step in range(1, 31)}  # start-up before step 10
    records = [*_records(times), {"step": 30, "eval": {"accuracy": 0.1}}]
    result = smoke.steady_throughput(records, samples_per_step=4 * 100, warmup=10)
    assert result["measured_steps"] == 20 and result["seconds"] == pytest.approx(10.0)
    assert result["samples_per_s"] == pytest.approx(20 * 100 * 4 / 10.0)
    assert result["ms_per_step"] == pytest.approx(500.0)


def test_logged_poisson_batch_sizes_do_not_enter_the_throughput():
    smoke = load_benchmark("distributed_smoke")
    times = {step: float(step) for step in range(1, 31)}
    expected = smoke.steady_throughput(_records(times), samples_per_step=400, warmup=10)
    assert smoke.steady_throughput(_records(times, batch=37), samples_per_step=400, warmup=10) == expected
    assert expected["samples_per_s"] == pytest.approx(400.0)


def test_too_few_synced_steps_is_a_clear_error():
    smoke = load_benchmark("distributed_smoke")
    with pytest.raises(ValueError, match="raise --steps"):
        smoke.steady_throughput(_records({step: float(step) for step in range(1, 15)}), samples_per_step=400, warmup=10)


def test_two_gloo_workers_log_no_batch_sizes_and_report_the_expected_batch_throughput(monkeypatch, capsys):
    """A real 2-process CPU run of a tiny model (about 15 s): no non-private statistics asked for or logged."""
    smoke = load_benchmark("distributed_smoke")
    commands, logs = [], []
    real_run = subprocess.run

    def run_and_keep_the_log(command, **kwargs):
        completed = real_run(command, **kwargs)
        commands.append(command)
        out = command[command.index("--out") + 1]
        logs.append([json.loads(line) for line in open(f"{out}/log.jsonl")])
        return completed

    monkeypatch.setattr(smoke.subprocess, "run", run_and_keep_the_log)
    argv = ["--gpus", "2", "--dataset", "synthetic", "--device", "cpu", "--steps", "3", "--warmup", "1"]
    argv += ["--batch-size", "8", "--aug-mult", "2", "--physical-batch-size", "16"]
    argv += ["--extra", "--model", "equiconvert:resnet9", "--model-kwargs", "widths=4,8,8", "--group", "C4"]
    assert smoke.main([*argv, "--set", "schedule.epsilon_every=1"]) == 0
    report = json.loads(capsys.readouterr().out)
    (command,) = commands
    assert not any("log_nonprivate_stats" in word for word in command)
    steps = [r for r in logs[0] if "lr" in r and "time_s" in r]  # step records (the final one has the total time)
    assert [r["step"] for r in steps] == [1, 2, 3] and not any("batch_size" in r for r in logs[0])
    (run,) = report["runs"]
    assert run["world_size"] == 2 and run["expected_samples_per_step"] == 2 * 8
    assert run["measured_steps"] == 2
    assert run["seconds"] == pytest.approx(steps[-1]["time_s"] - steps[0]["time_s"])
    assert run["samples_per_s"] == pytest.approx(2 * 8 * 2 / run["seconds"])
    assert run["samples_per_s_with_startup_and_evaluation"] == pytest.approx(2 * 8 * 3 / run["wall_time_s"])


def test_runs_take_the_first_of_the_callers_visible_devices():
    smoke = load_benchmark("distributed_smoke")
    assert smoke.visible_devices(2, {}) == "0,1"
    assert smoke.visible_devices(1, {"CUDA_VISIBLE_DEVICES": "3,2"}) == "3"
    assert smoke.visible_devices(2, {"CUDA_VISIBLE_DEVICES": "3, 2,1"}) == "3,2"
    with pytest.raises(ValueError, match="names only 1"):
        smoke.visible_devices(2, {"CUDA_VISIBLE_DEVICES": "5"})
