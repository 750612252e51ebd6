"""benchmarks/dp_engines.py times the same DP step in every engine: each one's noise-free update equals a per-example
loop's clipped update of its clipping unit, and the engines it cannot run are listed with the reason."""

import importlib.util
import json

import pytest
import torch

from tests.support.benchmark_scripts import load_benchmark

DP_ENGINES = ("dptrainer", "dptrainer_graph", "make_private", "opacus_hooks", "opacus_ghost")
HAS_JAX = importlib.util.find_spec("jax") is not None


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp_engines") / "dp_engines.json"
    threads = torch.get_num_threads()
    try:
        assert load_benchmark("dp_engines").main(["--tiny", "--models", "wrn16_4", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(out.read_text())


def test_report_names_card_versions_and_the_command(report):
    assert report["card"] and report["torch"] == torch.__version__ and report["opacus"]
    assert report["command"].startswith("python benchmarks/dp_engines.py --tiny")
    assert (report["batch"], report["aug_mult"], report["device"]) == (2, 2, "cpu")


def test_every_engine_is_timed_or_says_why_not(report):
    engines = report["results"]["wrn16_4"]["engines"]
    module = load_benchmark("dp_engine_adapters")
    assert list(engines) == list(module.ENGINES)
    for name in ("nonprivate", *DP_ENGINES):
        record = engines[name]
        assert record["ms_per_step"] > 0 and record["augmented_samples_per_s"] > 0, (name, record)
        assert record["peak_memory_gib"] is None and "CPU" in record["peak_memory_measured_by"]
    for name in DP_ENGINES:
        assert engines[name]["nonprivate_baseline"] == "nonprivate (fp32)"
        assert engines[name]["time_vs_own_nonprivate"] == pytest.approx(
            engines[name]["ms_per_step"] / engines["nonprivate"]["ms_per_step"]
        )
    assert engines["dptrainer"]["filter_gradient_kernels"] == {}  # on the CPU "auto" is "grouped": nothing is timed
    assert "filter_gradient_kernels" not in engines["opacus_hooks"]
    assert "--fastdp DIR" in engines["fastdp"]["not_run"]
    assert "--released DIR" in engines["released"]["not_run"]
    assert "--released DIR" in engines["released_nonprivate"]["not_run"]
    if not HAS_JAX:
        assert "jax does not import" in engines["jax"]["not_run"]


def test_each_dp_engine_steps_as_a_per_example_loop_with_the_noise_off(report):
    engines = report["results"]["wrn16_4"]["engines"]
    runs = [*DP_ENGINES, *(["jax"] if HAS_JAX else [])]
    for name in runs:
        check = engines[name]["noise_free_check"]
        assert check["clipped_examples"] == check["examples"] > 0, name  # clipping changes every update
        assert check["update_max_relative_difference"] < 1e-4, (name, check)
    assert {engines[n]["clipping_unit"] for n in runs} == {
        "example (mean of its K views)",
        "view (each of the B*K rows)",
    }


def test_the_check_tells_the_clipping_units_apart():
    """Clipping each view instead of each example moves the update far beyond the check's tolerance, so a passing
    check says which step an engine times."""
    bench = load_benchmark("dp_engines")
    args = type("Args", (), {"tiny": True, "image_size": 16, "aug_mult": 2, "clip": 2.0, "noise": 0.0, "lr": 0.5})
    args.channels_last = False
    args.fastdp = args.released = None
    case = bench.make_case(args, "wrn16_4", 2, torch.device("cpu"))
    start = {n: p.detach().clone() for n, p in case.model.named_parameters()}
    per_example = bench.naive_step(case.model, case.images, case.labels, 2, 2.0, 0.5, 2, "mean")
    with torch.no_grad():
        for n, p in case.model.named_parameters():
            p.copy_(start[n])
    flat, labels = case.views.flatten(0, 1), case.labels.repeat_interleave(2)
    per_view = bench.naive_step(case.model, flat, labels, 1, 2.0, 0.5, 4, "mean")
    difference = max(
        bench.relative_difference(per_view["after"][n] - start[n], per_example["after"][n] - start[n]) for n in start
    )
    assert difference > 1e-2


def test_opacus_engines_time_their_step_under_bf16_autocast_against_the_bf16_nonprivate_step(tmp_path):
    """Opacus computes per-sample gradients under autocast, so its engines are timed in the precision asked for, as
    DPTrainer is; make_private refuses autocast and stays fp32. The noise-free check runs in fp32 for every engine."""
    out = tmp_path / "bf16.json"
    engines = "nonprivate,opacus_hooks,opacus_ghost,make_private"
    threads = torch.get_num_threads()
    try:
        argv = ["--tiny", "--models", "wrn16_4", "--precision", "bf16", "--engines", engines, "--out", str(out)]
        assert load_benchmark("dp_engines").main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    records = json.loads(out.read_text())["results"]["wrn16_4"]["engines"]
    for name in ("opacus_hooks", "opacus_ghost"):
        assert records[name]["precision"] == "bf16" and records[name]["nonprivate_baseline"] == "nonprivate (bf16)"
        assert records[name]["noise_free_check"]["update_max_relative_difference"] < 1e-4, name
    assert records["make_private"]["precision"] == "fp32"
    assert records["make_private"]["nonprivate_baseline"] == "nonprivate (fp32)"


def test_channels_last_runs_record_the_layout_and_equiconverts_engines_stay_exact(tmp_path):
    out = tmp_path / "channels_last.json"
    threads = torch.get_num_threads()
    try:
        argv = ["--tiny", "--models", "wrn16_4", "--channels-last", "--engines", "nonprivate,dptrainer,make_private"]
        assert load_benchmark("dp_engines").main([*argv, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert report["channels_last"] is True
    for name in ("dptrainer", "make_private"):
        check = report["results"]["wrn16_4"]["engines"][name]["noise_free_check"]
        assert check["update_max_relative_difference"] < 1e-4, name
