"""benchmarks/accuracy.py: a real tiny grid through `equiconvert train`, the report on known numbers, failures."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.benchmark_scripts import load_benchmark
from tests.support.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "accuracy.py"
# A few seconds per run on a loaded 2-core CPU; the synthetic data set ignores --data-dir.
TINY_TRAIN = [
    "--model-kwargs",
    "widths=4,8,8",
    "--steps",
    "1",
    "--batch-size",
    "16",
    "--physical-batch-size",
    "16",
    "--aug-mult",
    "1",
    "--set",
    "schedule.checkpoint_every=0",
]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


accuracy = load_benchmark("accuracy")


def _run(out: Path, *options: str) -> subprocess.CompletedProcess:
    argv = [
        sys.executable,
        str(SCRIPT),
        "run",
        "--dataset",
        "synthetic",
        "--model",
        "equiconvert:resnet9",
        "--epsilons",
        "8",
        "--out",
        str(out),
        "--jobs-per-device",
        "2",
        *options,
        "--",
        *TINY_TRAIN,
    ]
    # two runs at a time, one thread each: the test machine has 2 cores
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600)


def _table_rows(table: str) -> list[str]:
    return [line for line in table.splitlines() if line.startswith("| ")]


def test_end_to_end_grid_resumes_and_summarizes(tmp_path):
    out = tmp_path / "grid"
    first = _run(out, "--groups", "none,D4", "--seeds", "0")
    assert first.returncode == 0, first.stdout + first.stderr
    # the same folder, D4 with a second seed: the finished D4 seed 0 is skipped, only seed 1 is trained
    second = _run(out, "--groups", "D4", "--seeds", "0,1")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "2 runs: 1 done (skipped), 0 to resume, 1 to start" in second.stdout

    names = {
        "none": ["synthetic_equiconvert-resnet9_none_eps8_seed0"],
        "D4": ["synthetic_equiconvert-resnet9_D4_eps8_seed0", "synthetic_equiconvert-resnet9_D4_eps8_seed1"],
    }
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["commands"]) == 2 and all("accuracy.py run" in c["command"] for c in summary["commands"])
    cells = {c["group"]: c for c in summary["cells"]}
    assert set(cells) == {"none", "D4"}
    for group, runs in names.items():
        results = [json.loads((out / name / "result.json").read_text()) for name in runs]
        assert all((out / name / "stdout.log").stat().st_size > 0 for name in runs)
        cell = cells[group]
        assert (cell["dataset"], cell["model"], cell["epsilon"], cell["n"]) == (
            "synthetic",
            "equiconvert:resnet9",
            8.0,
            len(runs),
        )
        assert [r["seed"] for r in cell["runs"]] == list(range(len(runs)))
        accs = [r["test_accuracy"] for r in results]
        assert cell["accuracy_median"] == statistics.median(accs)
        assert (cell["accuracy_min"], cell["accuracy_max"]) == (min(accs), max(accs))
        assert cell["brier_median"] == statistics.median(r["brier"] for r in results)
        assert cell["ece_median"] == statistics.median(r["ece"] for r in results)
        assert cell["wall_time_s_median"] == statistics.median(r["wall_time_s"] for r in results)
        assert cell["params"] == results[0]["params"]
        assert (cell["steps"], cell["requested_steps"], cell["batch_size"], cell["aug_mult"]) == (1, 1, 16, 1)
        assert cell["stopped_early"] == []
    assert cells["none"]["accuracy_std"] is None
    table = (out / "table.md").read_text()
    rows = _table_rows(table)
    assert any(r.startswith("| none (unconverted) | ") and "(1)" in r for r in rows)
    assert any(r.startswith("| D4 | ") and "(2)" in r for r in rows)
    assert "dataset: synthetic · model: equiconvert:resnet9 · delta: 1e-05 · device: cpu" in table
    assert (out / "accuracy_vs_epsilon.png").read_bytes()[:8] == PNG_SIGNATURE


def _fixture(out: Path, group: str, epsilon: float, seed: int, acc: float, params: int, **fields) -> None:
    run_dir = out / accuracy.run_name("fashion-mnist", "equiconvert:resnet9", group, epsilon, seed)
    run_dir.mkdir(parents=True)
    result = {
        "model": "equiconvert:resnet9",
        "group": group,
        "dataset": "fashion-mnist",
        "test_accuracy": acc,
        "brier": 1.0 - acc,
        "ece": 0.01,
        "epsilon": epsilon - 0.01,
        "delta": 1e-5,
        "target_epsilon": epsilon,
        "steps": 100,
        "batch_size": 2048,
        "aug_mult": 4,
        "params": params,
        "params_before": 300_000,
        "device": "cuda:0",
        "wall_time_s": 600.0 + seed,
        **fields,
    }
    (run_dir / "result.json").write_text(json.dumps(result))
    recorded = {"seed": seed, "epsilon": epsilon, "extra_args": ["--steps", "100"]}
    (run_dir / accuracy.RUN_FILE).write_text(json.dumps(recorded))


def test_report_on_known_results(tmp_path):
    for seed, acc in enumerate([0.84, 0.80, 0.82]):
        _fixture(tmp_path, "none", 3.0, seed, acc, 300_000, stopped_reason=None)
    # resumed after a time limit and then finished: result.json's stopped_reason wins over the old log event
    resumed = tmp_path / accuracy.run_name("fashion-mnist", "equiconvert:resnet9", "none", 3.0, 0)
    (resumed / "log.jsonl").write_text(json.dumps({"event": "stopped", "reason": "time_limit", "step": 50}) + "\n")
    for seed, acc in enumerate([0.92, 0.97, 0.90]):
        _fixture(tmp_path, "D4", 3.0, seed, acc, 255_675)
    _fixture(tmp_path, "D4", 8.0, 0, 0.95, 255_675, steps=70, stopped_reason="time_limit")
    _fixture(tmp_path, "none", 8.0, 0, 0.88, 300_000, steps=90)  # fewer steps than the recorded --steps 100

    assert accuracy.main(["report", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    d4 = next(c for c in summary["cells"] if (c["group"], c["epsilon"]) == ("D4", 3.0))
    assert d4["accuracy_median"] == 0.92 and d4["n"] == 3
    assert d4["accuracy_std"] == pytest.approx(statistics.stdev([0.92, 0.97, 0.90]))
    assert [r["seed"] for r in d4["runs"]] == [0, 1, 2]

    rows = _table_rows((tmp_path / "table.md").read_text())
    header = next(r for r in rows if r.startswith("| group | params"))
    assert "| ε = 3 | ε = 8 |" in header
    none_row = next(r for r in rows if r.startswith("| none (unconverted) | 300,000 |"))
    d4_row = next(r for r in rows if r.startswith("| D4 | 255,675 |"))
    assert "| 82.00 ± 2.00 (3) | 88.00 ± – (1) † |" in none_row
    assert "| 92.00 ± 3.61 (3) | 95.00 ± – (1) † |" in d4_row
    assert d4_row.endswith("| 10.0 min |")
    table = (tmp_path / "table.md").read_text()
    assert "- fashion-mnist_equiconvert-resnet9_D4_eps8_seed0: 70 of 100 steps (time_limit)" in table
    assert "- fashion-mnist_equiconvert-resnet9_none_eps8_seed0: 90 of 100 steps (fewer steps than requested)" in table
    assert "command: not recorded" in table
    assert "softmax averaged" not in table  # no run was evaluated with --test-shifts
    assert (tmp_path / "accuracy_vs_epsilon.png").read_bytes()[:8] == PNG_SIGNATURE


def test_report_adds_the_shift_averaged_accuracy_of_test_shift_runs(tmp_path):
    plain, averaged = [0.9005, 0.8984, 0.8982], [0.9018, 0.9006, 0.9010]
    for seed, (acc, avg) in enumerate(zip(plain, averaged)):
        _fixture(tmp_path, "D1", 3.0, seed, acc, 200_532, test_shifts="cross1", test_accuracy_shift_averaged=avg)
    for seed, acc in enumerate([0.8907, 0.8906]):  # the baseline evaluated without shifts: no averaged number
        _fixture(tmp_path, "none", 3.0, seed, acc, 155_146)

    assert accuracy.main(["report", "--out", str(tmp_path)]) == 0
    cells = {c["group"]: c for c in json.loads((tmp_path / "summary.json").read_text())["cells"]}
    d1, none = cells["D1"], cells["none"]
    assert d1["accuracy_median"] == 0.8984 and d1["shift_averaged_accuracy_median"] == 0.9010
    assert d1["shift_averaged_accuracy_std"] == pytest.approx(statistics.stdev(averaged))
    assert (d1["test_shifts"], d1["shift_averaged_n"]) == ("cross1", 3)
    assert [r["test_accuracy_shift_averaged"] for r in d1["runs"]] == averaged
    assert (none["shift_averaged_n"], none["shift_averaged_accuracy_median"], none["test_shifts"]) == (0, None, None)

    table = (tmp_path / "table.md").read_text()
    assert "(`--test-shifts cross1`: post-processing, no privacy cost)" in table
    rows = _table_rows(table)
    assert "| D1 | 90.10 ± 0.06 (3) |" in rows
    assert "| none (unconverted) | – |" in rows
    assert "| D1 | 200,532 | 89.84 ± 0.13 (3) | 10.0 min |" in rows


def test_failed_run_is_named_and_does_not_stop_the_others(tmp_path):
    out = tmp_path / "grid"
    proc = _run(out, "--groups", "Q7,none", "--seeds", "0")
    assert proc.returncode != 0
    failed = "synthetic_equiconvert-resnet9_Q7_eps8_seed0"
    assert f"--- {failed}: exit status" in proc.stderr
    assert "error:" in proc.stderr  # the tail of the run's log, with train's one-line error
    assert (out / "synthetic_equiconvert-resnet9_none_eps8_seed0" / "result.json").exists()
    assert not (out / failed / "result.json").exists()
    assert [c["group"] for c in json.loads((out / "summary.json").read_text())["cells"]] == ["none"]


def test_plan_resumes_from_checkpoints_and_refuses_other_train_arguments(tmp_path):
    runs = accuracy.build_grid("synthetic", "equiconvert:resnet9", ["none", "D4"], [8.0], [0])
    (tmp_path / runs[0].name).mkdir()
    (tmp_path / runs[0].name / "checkpoint.pt").write_bytes(b"")
    assert accuracy.plan(runs, tmp_path, ["--steps", "2"]) == ([], [runs[0]], [runs[1]])
    cmd = accuracy.train_command(runs[0], tmp_path / runs[0].name, "cuda:1", None, ["--steps", "2"], resume=True)
    assert cmd[-5:] == ["--steps", "2", "--device", "cuda:1", "--resume"]

    (tmp_path / runs[1].name).mkdir()
    (tmp_path / runs[1].name / "result.json").write_text("{}")
    (tmp_path / runs[1].name / accuracy.RUN_FILE).write_text(json.dumps({"extra_args": ["--steps", "5"]}))
    with pytest.raises(SystemExit, match="other train arguments"):
        accuracy.plan(runs, tmp_path, ["--steps", "2"])
    # a run stopped by train's --time-limit is done, unless asked to continue it from its checkpoint
    (tmp_path / runs[1].name / "result.json").write_text(json.dumps({"stopped_reason": "time_limit"}))
    (tmp_path / runs[1].name / "checkpoint.pt").write_bytes(b"")
    assert accuracy.plan(runs, tmp_path, ["--steps", "5"]) == ([runs[1]], [runs[0]], [])
    assert accuracy.plan(runs, tmp_path, ["--steps", "5"], continue_stopped=True) == ([], [runs[0], runs[1]], [])
    with pytest.raises(SystemExit, match="--device is set by the benchmark"):
        accuracy.check_extra_args(["--steps", "2", "--device=cuda"])
    assert (
        accuracy.run_name("fashion-mnist", "timm:resnet50d", "D4", 0.5, 2)
        == "fashion-mnist_timm-resnet50d_D4_eps0.5_seed2"
    )
