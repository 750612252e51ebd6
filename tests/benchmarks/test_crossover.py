"""benchmarks/crossover.py: every checkout meets every GPU, no GPU runs two jobs at once, and the report's numbers
are the runs' own."""

import json
import statistics
from collections import Counter

import pytest

from tests.support.benchmark_scripts import load_benchmark
from tests.support.paths import REPO_ROOT

crossover = load_benchmark("crossover")


def test_each_wave_uses_each_gpu_once_and_each_checkout_visits_every_gpu():
    names, gpus = ["a", "b", "c"], ["0", "1"]
    waves = crossover.schedule(names, gpus, rounds=2)
    runs = [run for wave in waves for run in wave]
    assert all(len({run.gpu for run in wave}) == len(wave) for wave in waves)
    assert Counter(run.checkout for run in runs) == {"a": 2, "b": 2, "c": 2}
    assert all({run.gpu for run in runs if run.checkout == name} == set(gpus) for name in names)
    assert [run.round for run in runs] == [0, 0, 0, 1, 1, 1]


def test_without_gpus_the_checkouts_run_one_at_a_time():
    waves = crossover.schedule(["a", "b"], [None], rounds=2)
    assert [[(run.checkout, run.round, run.gpu) for run in wave] for wave in waves] == [
        [("a", 0, None)],
        [("b", 0, None)],
        [("a", 1, None)],
        [("b", 1, None)],
    ]


def test_a_folder_without_equiconvert_is_refused_by_its_flag_before_anything_runs(tmp_path, capsys):
    (tmp_path / "benchmarks").mkdir()
    with pytest.raises(SystemExit):
        crossover.main(["--checkout", f"old={tmp_path}", "--", "--device", "cpu"])
    err = capsys.readouterr().err
    assert f"--checkout 'old={tmp_path}'" in err and "equiconvert/__init__.py" in err


def test_two_checkouts_on_cpu_give_each_runs_times_and_their_ratio(tmp_path, capsys):
    checkouts = []
    for name in ("before", "after"):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "equiconvert").symlink_to(REPO_ROOT / "equiconvert")
        (folder / "benchmarks").symlink_to(REPO_ROOT / "benchmarks")
        checkouts += ["--checkout", f"{name}={folder}"]
    out = tmp_path / "crossover.json"
    tiny = ["--device", "cpu", "--widths", "4,8,8", "--group", "C4", "--batch", "2", "--aug-mult", "2"]
    argv = [*checkouts, "--rounds", "1", "--out", str(out), "--", *tiny, "--methods", "nonprivate,bookkeeping"]
    assert crossover.main(argv) == 0
    capsys.readouterr()
    report = json.loads(out.read_text())
    assert [(r["checkout"], r["round"], r["gpu"]) for r in report["runs"]] == [("before", 0, None), ("after", 0, None)]
    for name in ("before", "after"):
        times = [r["results"]["bookkeeping"]["ms_per_step"] for r in report["runs"] if r["checkout"] == name]
        entry = report["summary"][name]["bookkeeping"]
        assert entry["ms_per_step"] == times and entry["median_ms_per_step"] == statistics.median(times) > 0
    before, after = (report["summary"][n]["bookkeeping"]["median_ms_per_step"] for n in ("before", "after"))
    assert report["summary"]["after"]["bookkeeping"]["vs_first"] == pytest.approx(after / before, abs=1e-4)
    assert report["summary"]["before"]["nonprivate"]["vs_first"] == 1.0
    assert len(report["devices"]) == 1


def test_a_run_that_timed_another_checkouts_code_is_refused(tmp_path, monkeypatch):
    """A report naming an equiconvert/ outside the checkout means the comparison compared nothing."""
    folder = tmp_path / "before"
    (folder / "equiconvert").mkdir(parents=True)

    def fake_run(command, **kwargs):
        out = command[command.index("--out") + 1]
        (tmp_path / "report").write_text(json.dumps({"equiconvert": str(REPO_ROOT / "equiconvert"), "results": {}}))
        (tmp_path / "report").replace(out)
        return crossover.subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(crossover.subprocess, "run", fake_run)
    with pytest.raises(RuntimeError, match="imported equiconvert from .*, not from .*before"):
        crossover.run_one(crossover.Run("before", 0, None), folder, [], timeout=10)


def test_the_throughput_arguments_may_not_set_out(tmp_path, capsys):
    with pytest.raises(SystemExit):
        crossover.main(["--checkout", f"a={REPO_ROOT}", "--", "--out", str(tmp_path / "x.json")])
    assert "must not set --out" in capsys.readouterr().err
