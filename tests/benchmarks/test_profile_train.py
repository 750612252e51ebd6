"""benchmarks/profile_train.py: a `train` step's ranges around the DP step are found and reported per step."""

import json

import pytest

from tests.support.benchmark_scripts import load_benchmark

TRAINER_RANGES = (
    "equiconvert/sample",
    "equiconvert/gather_and_augment",
    "equiconvert/noise",
    "equiconvert/update_and_ema",
)


def test_profile_reports_the_trainers_ranges_beside_the_steps(tmp_path):
    out = tmp_path / "profile_train.json"
    argv = ["--device", "cpu", "--dataset", "synthetic", "--synthetic-examples", "64", "--batch-size", "8"]
    argv += ["--aug-mult", "2", "--physical-batch-size", "4", "--warmup", "2", "--steps", "2", "--fuse-norm-pools"]
    assert load_benchmark("profile_train").main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    phases = report["phases"]
    assert set(TRAINER_RANGES) <= set(phases)
    assert {"equiconvert/forward", "equiconvert/per_example/SteerableConv2d"} <= set(phases)
    assert all(phases[name]["cpu_ms"] > 0 for name in TRAINER_RANGES)
    # the trainer's ranges nest in no other and are per step, as the wall time is
    assert sum(phases[name]["cpu_ms"] for name in TRAINER_RANGES) < report["wall_ms_per_step"]
    assert report["fused_norm_pools"] == 3  # the paper model's three norm -> max-pool pairs
    assert report["device"] == "cpu" and report["steps"] == 2


def test_profile_refuses_a_run_without_warm_up(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_benchmark("profile_train").main(["--device", "cpu", "--warmup", "0", "--out", str(tmp_path / "p.json")])
    assert "--warmup and --steps" in capsys.readouterr().err


def test_kernel_time_leaves_out_the_device_spans_of_the_ranges_and_the_profiler_steps():
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def on_device(id_: int, name: str, start: int, end: int) -> FunctionEvent:
        return FunctionEvent(id_, name, 0, start, end, use_device="cuda", device_type=DeviceType.CUDA)

    events = [
        on_device(1, "gemm", 0, 3_000),  # 3 ms
        on_device(2, "copy", 3_000, 4_000),  # 1 ms
        on_device(3, "equiconvert/forward", 0, 4_000),  # the range's span over both kernels
        on_device(4, "ProfilerStep#7", 0, 5_000),  # the schedule's step, over everything
        FunctionEvent(5, "aten::mm", 0, 0, 9_000),  # a host event
    ]
    assert load_benchmark("profile_train").kernel_ms_per_step(events, steps=2) == 2.0
