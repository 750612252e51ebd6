"""benchmarks/profile_step.py: the step's phases are found and reported for both methods."""

import json

import torch

from tests.support.benchmark_scripts import load_benchmark


def test_profile_reports_the_dp_steps_phases(tmp_path):
    out = tmp_path / "profile.json"
    profile_step = load_benchmark("profile_step")
    assert (
        profile_step.main(
            ["--device", "cpu", "--batch", "2", "--aug-mult", "2", "--steps", "1", "--top", "30", "--out", str(out)]
        )
        == 0
    )
    report = json.loads(out.read_text())
    phases = report["results"]["bookkeeping"]["phases"]
    expected = {
        "equiconvert/forward",
        "equiconvert/backward",
        "equiconvert/per_example/SteerableConv2d",
        "equiconvert/per_example/Linear",
        "equiconvert/clip_and_sum",
    }
    assert set(phases) == expected  # no "other" on CPU: the rest is only defined for device kernels
    assert all(phase["cpu_ms"] > 0 for phase in phases.values())
    assert report["results"]["nonprivate"]["phases"] == {}  # the non-private step runs none of book-keeping's code
    assert report["device"] == "cpu" and report["batch"] == 2 and report["channels_last"] is False
    host = {method: result["host_operators"] for method, result in report["results"].items()}
    assert host["bookkeeping"]["total"] > host["nonprivate"]["total"] > 0  # the DP step dispatches more
    dp_step_sources = {row["source"] for row in host["bookkeeping"]["by_source"] if "dp_step.py" in row["source"]}
    assert dp_step_sources and not any("dp_step.py" in row["source"] for row in host["nonprivate"]["by_source"])


def test_profile_of_the_plain_wrn_finds_its_conv_and_norm_layers(tmp_path):
    out = tmp_path / "profile.json"
    argv = ["--device", "cpu", "--model", "wrn16_4", "--batch", "2", "--aug-mult", "2", "--steps", "1", "--top", "3"]
    assert load_benchmark("profile_step").main([*argv, "--out", str(out)]) == 0
    phases = json.loads(out.read_text())["results"]["bookkeeping"]["phases"]
    assert {"equiconvert/per_example/Conv2d", "equiconvert/per_example/GroupNorm"} <= set(phases)
    assert "equiconvert/per_example/SteerableConv2d" not in phases


def test_profile_in_channels_last_format_runs_the_same_phases(tmp_path):
    out = tmp_path / "profile.json"
    argv = ["--device", "cpu", "--batch", "2", "--aug-mult", "2", "--steps", "1", "--top", "3", "--channels-last"]
    assert load_benchmark("profile_step").main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["channels_last"] is True
    assert "equiconvert/per_example/SteerableConv2d" in report["results"]["bookkeeping"]["phases"]


def test_a_phases_device_time_is_its_kernels_not_the_span_they_cover():
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def event(id_: int, name: str, start: int, end: int, device_type=DeviceType.CPU) -> FunctionEvent:
        return FunctionEvent(id_, name, 0, start, end, use_device="cuda", device_type=device_type)

    profile_step = load_benchmark("profile_step")
    steps = []
    for step in range(2):  # two steps: the phase's times add up over them and are reported per step
        phase = event(10 * step, "equiconvert/per_example/Conv2d", 0, 5_000)
        op = event(10 * step + 1, "aten::einsum", 100, 200)
        op.append_kernel("gemm", 0, 1_000)  # 1 ms of kernels launched by an op inside the range
        phase.append_cpu_child(op)
        phase.append_kernel("copy", 0, 500)
        # the range's span on the device: 9 ms from its first kernel's start to its last one's end
        span = event(10 * step + 2, "equiconvert/per_example/Conv2d", 0, 9_000, DeviceType.CUDA)
        steps += [phase, op, span]
    phases = profile_step.phase_times(steps, steps=2)
    assert set(phases) == {"equiconvert/per_example/Conv2d"}
    assert phases["equiconvert/per_example/Conv2d"]["device_ms"] == 1.5
    assert phases["equiconvert/per_example/Conv2d"]["cpu_ms"] == 5.0
    kernels = profile_step.phase_kernels(steps, steps=2, top=5)  # the same kernels, by name: the phase's make-up
    assert kernels == {
        "equiconvert/per_example/Conv2d": [
            {"name": "gemm", "device_ms": 1.0, "calls": 1},
            {"name": "copy", "device_ms": 0.5, "calls": 1},
        ]
    }


def test_host_operators_are_counted_by_the_equiconvert_function_that_dispatched_them():
    profile_step = load_benchmark("profile_step")

    def step(model, optimizer, views, labels):
        model(views).sum().backward()  # outside equiconvert
        dp_step.per_sample_norms({"w": views})  # reshape's view, pow, sum, stack, sum, sqrt: from dp_step.py

    from equiconvert.privacy import dp_step

    model = torch.nn.Linear(3, 1)
    views = torch.ones(2, 3)
    counted = profile_step.count_host_operators(step, model, views, torch.zeros(2), top=5)
    sources = {row["source"]: row["operators"] for row in counted["by_source"]}
    assert sources["privacy/dp_step.py:per_sample_norms"] == 6
    assert counted["total"] == sum(sources.values()) and sources["outside equiconvert"] > 0
