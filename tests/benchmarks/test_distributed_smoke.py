"""benchmarks/distributed_smoke.py measures steady-state samples/s from the steps whose record waited for the device."""

import pytest

from tests.support.benchmark_scripts import load_benchmark


def _records(times: dict[int, float], batch: int = 100) -> list[dict]:
    return [
        {"step": step, "batch_size": batch, "time_s": time, **({"epsilon": 1.0} if step % 10 == 0 else {})}
        for step, time in times.items()
    ]


def test_throughput_spans_the_synced_steps_after_warmup():
    smoke = load_benchmark("distributed_smoke")
    times = {step: 0.5 * step + (5.0 if step >= 10 else 0.0) for step in range(1, 31)}  # start-up before step 10
    result = smoke.steady_throughput(_records(times), aug_mult=4, warmup=10)
    assert result["measured_steps"] == 20 and result["seconds"] == pytest.approx(10.0)
    assert result["samples_per_s"] == pytest.approx(20 * 100 * 4 / 10.0)
    assert result["ms_per_step"] == pytest.approx(500.0)


def test_too_few_synced_steps_is_a_clear_error():
    smoke = load_benchmark("distributed_smoke")
    with pytest.raises(ValueError, match="raise --steps"):
        smoke.steady_throughput(_records({step: float(step) for step in range(1, 15)}), aug_mult=4, warmup=10)
