"""Recipe tables: the shipped paper table, the loader's refusals, and `benchmarks/accuracy.py table` end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from equiconvert.recipes.table import TableError, load_table, shipped_tables

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "accuracy.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {"kind", "title", "description", "command", "card", "date", "rows", "notes", "figure"}
ROW_KEYS = {"model", "epsilon", "params", "accuracy", "gpu_hours", "setting", "paper", "command", "seeds", "seeds_run"}


def _script(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module, registered in sys.modules (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"{name}_table_test", REPO_ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


accuracy = _script("accuracy")
tables = accuracy.recipe_table  # imported by accuracy.py, as it runs the `table` command
page = _script("make_results_page")

# two steps of a tiny ResNet9 on the synthetic data set: seconds on one CPU thread
TINY_RECIPE = """
[model]
name = "equiconvert:resnet9"
kwargs = { widths = [4, 8, 8] }

[conversion]
group = "D4"

[data]
dataset = "synthetic"

[dp]
epsilon = 8.0
batch_size = 16
physical_batch_size = 16
aug_mult = 1

[schedule]
steps = 2
checkpoint_every = 0
"""
TINY_TABLE = """
title = "Tiny"
description = "Two cells on the synthetic data set."
figure = "img/tiny.png"
figure_title = "tiny: ours and the paper's"

[[cells]]
name = "d4"
model = "D4 ResNet9"
recipe = "tiny.toml"
seeds = [0]
paper = 50.0

[[cells]]
name = "plain"
model = "unconverted"
recipe = "tiny.toml"
set = ["conversion.group=none", "dp.epsilon=3"]
seeds = [0]
"""
PASS_THROUGH = ["--set", "schedule.eval_every=2"]


def _tiny_table(folder: Path, text: str = TINY_TABLE) -> Path:
    (folder / "tiny.toml").write_text(TINY_RECIPE)
    (folder / "table.toml").write_text(text)
    return folder / "table.toml"


def _table(table: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(SCRIPT), "table", str(table), "--out", str(out), "--device", "cpu", *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*argv, "--", *PASS_THROUGH], capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600
    )


def test_the_shipped_paper_table_has_the_papers_rows():
    assert "cifar10_paper" in shipped_tables()
    table = load_table("cifar10_paper")
    rows = [(c.name, c.recipe, c.epsilon, c.seeds, c.paper) for c in table.cells]
    d4, baseline = "cifar10_paper_d4_eps8", "cifar10_paper_baseline_eps8"
    assert rows == [
        ("d4_eps8", d4, 8.0, (0, 1, 2), 81.62),
        ("d4_eps6", d4, 6.0, (0,), 80.26),
        ("d4_eps4", d4, 4.0, (0, 1), 78.27),
        ("d4_eps3", d4, 3.0, (0, 1, 2), 75.96),
        ("d4_eps1", d4, 1.0, (0, 1), 60.59),
        ("baseline_eps8", baseline, 8.0, (0,), None),
        ("baseline_eps3", baseline, 3.0, (0,), None),
        ("d4_eps8_released", "cifar10_paper_d4_eps8_released", 8.08, (0,), 81.62),
    ]
    assert table.figure == "img/cifar10_paper_table.png" and "JPEG" in table.figure_title
    # every cell's first seed before any cell's second, every second before any third
    order = [r.name for r in tables.table_runs(list(table.cells))]
    assert order[0] == "d4_eps8_seed0" and len(order) == 14
    assert order[-6:] == [
        "d4_eps8_seed1",
        "d4_eps4_seed1",
        "d4_eps3_seed1",
        "d4_eps1_seed1",
        "d4_eps8_seed2",
        "d4_eps3_seed2",
    ]
    assert tables.TableRun(table.cells[3], 0).fixed_args == (
        "--recipe",
        d4,
        "--set",
        "dp.epsilon=3",
        "--seed",
        "0",
    )


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ('name = "a"\nmodel = "m"\nrecipe = "tiny.toml"\nseeds = [0]\nsed = 1', r"cells\[0\]: unknown key 'sed'"),
        ('name = "a"\nmodel = "m"\nseeds = [0]', r"cells\[0\]: recipe is missing"),
        ('name = "a"\nmodel = "m"\nrecipe = "tiny.toml"\nseeds = [0, 0]', r"cells\[0\] \(a\): seeds \[0, 0\] repeats"),
        ('name = "a"\nmodel = "m"\nrecipe = "tiny.toml"\nseeds = ["0"]', r"cells\[0\] \(a\): seeds must be"),
        ('name = "a/b"\nmodel = "m"\nrecipe = "tiny.toml"\nseeds = [0]', r"cells\[0\]: name 'a/b' must be"),
        (
            'name = "a"\nmodel = "m"\nrecipe = "tiny.toml"\nseeds = [0]\nset = ["dp.nope=1"]',
            r"cells\[0\] \(a\): assignments=dp.nope=1: unknown recipe key 'dp.nope'",
        ),
        (
            'name = "a"\nmodel = "m"\nrecipe = "missing.toml"\nseeds = [0]',
            r"cells\[0\] \(a\): name_or_path=.*missing.toml",
        ),
        (
            'name = "a"\nmodel = "m"\nrecipe = "tiny.toml"\nseeds = [0]\npaper = "81"',
            r"cells\[0\] \(a\): paper must be a number",
        ),
    ],
)
def test_a_bad_table_is_refused_naming_the_file_and_key(tmp_path, cell, message):
    path = _tiny_table(tmp_path, f'title = "T"\ndescription = "D"\n\n[[cells]]\n{cell}\n')
    with pytest.raises(TableError, match=f"^{path}: {message}"):
        load_table(str(path))


def test_table_level_mistakes_are_refused(tmp_path):
    path = _tiny_table(tmp_path, TINY_TABLE.replace('title = "Tiny"', 'titel = "Tiny"'))
    with pytest.raises(TableError, match=f"^{path}: unknown key 'titel'"):
        load_table(str(path))
    path = _tiny_table(tmp_path, TINY_TABLE.replace('name = "plain"', 'name = "d4"'))
    with pytest.raises(TableError, match="the name 'd4' is used twice"):
        load_table(str(path))
    with pytest.raises(TableError, match="neither a file nor a shipped table .*cifar10_paper"):
        load_table("no_such_table")
    with pytest.raises(ValueError, match="^cells: d5 not in .*its cells: d4, plain"):
        load_table(str(_tiny_table(tmp_path))).select(["d5"])
    with pytest.raises(SystemExit, match="error: --cells: d5 not in"):  # the command says it too
        accuracy.main(["table", str(tmp_path / "table.toml"), "--out", str(tmp_path / "out"), "--cells", "d5"])


def test_tiny_table_end_to_end_then_skipped(tmp_path):
    out = tmp_path / "out"
    first = _table(_tiny_table(tmp_path), out)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "2 runs of 2 cells: 0 done (skipped), 0 to resume, 2 to start" in first.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS and summary["kind"] == "paper_table"
    assert summary["figure"] == {"path": "img/tiny.png", "title": "tiny: ours and the paper's"}
    assert summary["card"] == "1 x cpu" and "accuracy.py table" in summary["command"]
    results = [json.loads((out / f"{n}_seed0" / "result.json").read_text()) for n in ("d4", "plain")]
    for row, result, (model, epsilon, paper) in zip(
        summary["rows"], results, [("D4 ResNet9", 8, 50.0), ("unconverted", 3, None)]
    ):
        assert set(row) == ROW_KEYS
        assert (row["model"], row["epsilon"], row["paper"], row["params"]) == (model, epsilon, paper, result["params"])
        assert row["accuracy"] == [round(100 * result["test_accuracy"], 2)]
        assert row["gpu_hours"] == round(result["wall_time_s"] * result["world_size"] / 3600, 3)
        assert row["setting"] == "paper's + --set schedule.eval_every=2"
        assert (result["steps"], result["requested_steps"], result["stopped_reason"]) == (2, 2, None)
    assert results[0]["group"] == "D4" and results[1]["group"] == "none" and results[1]["target_epsilon"] == 3
    png = (out / "accuracy_vs_epsilon.png").read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) < 100_000
    assert "| D4 ResNet9 | 8 | " in (out / "table.md").read_text()

    # copied into the results page's summaries, it renders with its figure
    summaries = tmp_path / "summaries"
    summaries.mkdir()
    (summaries / "tiny.json").write_text((out / "summary.json").read_text())
    assert page.main(["--summaries", str(summaries), "--out", str(tmp_path / "docs" / "results.md")]) == 0
    assert "![tiny: ours and the paper's](img/tiny.png)" in (tmp_path / "docs" / "results.md").read_text()
    assert (tmp_path / "docs" / "img" / "tiny.png").read_bytes()[:8] == PNG_SIGNATURE
    check = ["--summaries", str(summaries), "--out", str(tmp_path / "docs" / "results.md"), "--check"]
    assert page.main(check) == 0
    (tmp_path / "docs" / "img" / "tiny.png").unlink()
    assert page.main(check) == 1  # the page names a figure that is not there

    (out / "summary.json").unlink()  # the report alone rebuilds it from the folder
    assert accuracy.main(["report", "--out", str(out)]) == 0
    assert json.loads((out / "summary.json").read_text())["rows"] == summary["rows"]

    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/result.json")}
    second = _table(tmp_path / "table.toml", out)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "2 runs of 2 cells: 2 done (skipped), 0 to resume, 0 to start" in second.stdout
    assert "start " not in second.stdout and "resume " not in second.stdout
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/result.json")} == stamps


def test_a_run_stopped_with_a_checkpoint_is_resumed_to_its_last_step(tmp_path):
    table, out = _tiny_table(tmp_path), tmp_path / "out"
    (tmp_path / "tiny.toml").write_text(TINY_RECIPE.replace("steps = 2", "steps = 3"))
    cell = load_table(str(table)).cells[0]
    run = tables.TableRun(cell, 0)
    # the first part: the command the table gives this run, stopped by a time limit after its first step
    first = tables.table_command(run, out / run.name, None, PASS_THROUGH, "cpu", 1, 0.01, resume=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run(first, check=True, capture_output=True, cwd=REPO_ROOT, env=env, timeout=600)
    stopped = json.loads((out / run.name / "result.json").read_text())
    assert (stopped["steps"], stopped["stopped_reason"]) == (1, "time_limit")

    proc = _table(table, out, "--cells", "d4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 runs of 1 cells: 0 done (skipped), 1 to resume, 0 to start" in proc.stdout
    result = json.loads((out / run.name / "result.json").read_text())
    assert (result["steps"], result["requested_steps"], result["stopped_reason"]) == (3, 3, None)
    assert "--resume" in (out / run.name / "stdout.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"][0]["accuracy"] == [round(100 * result["test_accuracy"], 2)]
    assert summary["rows"][1]["accuracy"] == []  # the cell not asked for


def test_a_budget_too_small_starts_nothing_and_names_the_unfinished_cells(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["table", str(_tiny_table(tmp_path)), "--out", str(out), "--time-limit", "100", "--startup-margin", "60"]
    assert accuracy.main([*argv, "--device", "cpu", "--", *PASS_THROUGH]) == tables.UNFINISHED_EXIT
    assert "unfinished cells: d4 (seed 0); plain (seed 0); 2 not started" in capsys.readouterr().err
    assert not list(out.glob("*/stdout.log"))  # no train was started
    summary = json.loads((out / "summary.json").read_text())
    assert [r["accuracy"] for r in summary["rows"]] == [[], []]


def test_each_run_gets_what_is_left_of_the_budget(tmp_path, monkeypatch):
    calls = []

    def fake_execute(name, run_dir, cmd, record, resume, say, where, env=None):
        calls.append((name, cmd, record, env))
        tables.time.sleep(0.05)

    monkeypatch.setattr(tables, "execute", fake_execute)
    table = _tiny_table(tmp_path)
    argv = ["table", str(table), "--out", str(tmp_path / "out"), "--time-limit", "1000", "--startup-margin", "100"]
    code = accuracy.main([*argv, "--nproc-per-node", "2", "--gpus", "0,1,2,3", "--", *PASS_THROUGH])
    assert code == tables.UNFINISHED_EXIT  # nothing really trained
    assert sorted(c[0] for c in calls) == ["d4_seed0", "plain_seed0"]
    for name, cmd, record, env in calls:
        limit = float(cmd[cmd.index("--time-limit") + 1])
        assert 890 <= limit <= 900 and record["time_limit_s"] == pytest.approx(limit, abs=1)
        assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and cmd[-1] == "--overwrite"
        assert env["CUDA_VISIBLE_DEVICES"] in ("0,1", "2,3") and record["pass_through"] == PASS_THROUGH
    with pytest.raises(SystemExit, match="not a multiple of --nproc-per-node 2"):
        tables.table_slots(["0", "1", "2"], 2, None)
    with pytest.raises(SystemExit, match="dp.epsilon is set by the table's cells"):
        accuracy.main([*argv, "--", "--set", "dp.epsilon=2"])
    with pytest.raises(SystemExit, match="--time-limit is set by the benchmark"):
        accuracy.main([*argv, "--", "--time-limit", "5"])


def test_summary_counts_finished_runs_and_sums_gpu_hours_over_parts():
    definition = {
        "title": "T",
        "description": "D",
        "order": 3,
        "notes": ["static"],
        "figure": None,
        "cells": [
            {"name": "a", "model": "M", "recipe": "r", "set": [], "epsilon": 8.0, "seeds": [0, 1, 2], "paper": 81.62},
            {
                "name": "b",
                "model": "N",
                "recipe": "r",
                "set": ["dp.epsilon=3"],
                "epsilon": 3.0,
                "seeds": [0],
                "paper": None,
            },
        ],
    }
    h200 = {"device": "cuda:0 (NVIDIA H200)", "world_size": 2, "params": 255675, "requested_steps": 2200}
    runs = {
        "a_seed0": {
            "result": {**h200, "test_accuracy": 0.7919, "steps": 2200, "stopped_reason": None, "epsilon": 7.99},
            "recorded": {"pass_through": ["--set", "dp.precision=bf16"]},
            "parts": [
                {"wall_time_s": 450.0, "world_size": 2, "finished": "2026-11-26T10:00:00+00:00"},
                {"wall_time_s": 585.0, "world_size": 2, "finished": "2026-11-27T10:00:00+00:00"},
            ],
        },
        "a_seed1": {  # no parts recorded (run by hand): its result's own wall time
            "result": {**h200, "test_accuracy": 0.8021, "steps": 2200, "stopped_reason": None, "wall_time_s": 927.0},
            "recorded": {"pass_through": ["--set", "dp.precision=bf16"]},
            "parts": [],
        },
        "a_seed2": {  # stopped by a time limit: not counted
            "result": {**h200, "test_accuracy": 0.5, "steps": 1000, "stopped_reason": "time_limit"},
            "parts": [{"wall_time_s": 500.0, "world_size": 2}],
        },
    }
    summary = accuracy.paper_table.summarize(definition, runs, "accuracy.py table T")
    assert set(summary) == SUMMARY_KEYS - {"figure"} | {"order"}
    a, b = summary["rows"]
    assert a == {
        "model": "M",
        "epsilon": 8,
        "params": 255675,
        "accuracy": [79.19, 80.21],
        "gpu_hours": 1.09,  # (2 x (450 + 585) + 2 x 927) / 3600
        "setting": "paper's + --set dp.precision=bf16",
        "paper": 81.62,
        "command": "equiconvert train --recipe r --seed S",
        "seeds": [0, 1, 2],
        "seeds_run": [0, 1],
    }
    assert (b["accuracy"], b["gpu_hours"], b["params"], b["setting"]) == ([], None, None, "paper's")
    assert b["command"] == "equiconvert train --recipe r --set dp.epsilon=3 --seed 0"
    assert (summary["card"], summary["date"], summary["order"]) == ("2 x NVIDIA H200", "2026-11-27", 3)
    assert summary["notes"][0] == "static"
    assert "a_seed2: stopped at step 1000 of 2200 (time_limit); not counted until resumed." in summary["notes"]
    text = "\n".join(page.render_section(summary))
    assert "| M | 8 | 255,675 | **79.70%** (2) | 0.72 | 1.09 | 81.62% | -1.92 |" in text
    assert "- M, epsilon 8: paper's + --set dp.precision=bf16\n" in text  # the setting, listed under the table
    assert (
        "- M, epsilon 8: `equiconvert train --recipe r --seed S`, S = 0, 1, 2 (run: seeds 0, 1; not run: seed 2)"
        in text
    )
    assert "- N, epsilon 3: `equiconvert train --recipe r --set dp.epsilon=3 --seed 0`\n" in text + "\n"


def test_the_plot_ticks_near_epsilons_once_and_draws_a_shared_paper_number_once(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, ax = plt.subplots()
    accuracy.paper_table.epsilon_axis(ax, [3, 8, 8.08, 6, 3])
    assert list(ax.get_xticks()) == [3, 6, 8]
    plt.close("all")

    drawn: list[tuple[str, list[float]]] = []
    original = matplotlib.axes.Axes.plot

    def recording_plot(self, x, y, *args, **kwargs):
        drawn.append((kwargs.get("label", ""), list(x)))
        return original(self, x, y, *args, **kwargs)

    rows = [
        {"model": "ours", "epsilon": 8, "accuracy": [79.0], "paper": 81.62},
        {"model": "released", "epsilon": 8.08, "accuracy": [80.0], "paper": 81.62},
        {"model": "released", "epsilon": 3, "accuracy": [], "paper": 70.0},
    ]
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    accuracy.paper_table.plot({"title": "t", "rows": rows}, tmp_path / "p.png")
    paper_lines = [(label, x) for label, x in drawn if label.startswith("paper")]
    assert paper_lines == [("paper: ours", [8]), ("paper: released", [3])]
    assert (tmp_path / "p.png").is_file()


def test_the_plot_draws_each_cell_with_its_measured_effects_removed(tmp_path, monkeypatch):
    import matplotlib.axes

    drawn: list[tuple[str, list[float], list[float]]] = []
    original = matplotlib.axes.Axes.plot

    def recording_plot(self, x, y, *args, **kwargs):
        drawn.append((kwargs.get("label", ""), list(x), list(y)))
        return original(self, x, y, *args, **kwargs)

    effects = [{"effect": "a", "points": -1.5, "source": "s"}, {"effect": "b", "points": -0.25, "source": "s"}]
    rows = [
        {"model": "ours", "epsilon": 3, "accuracy": [70.0], "paper": 73.0},
        {"model": "ours", "epsilon": 8, "accuracy": [78.0, 79.0, 80.0], "paper": 81.0, "explained": effects},
    ]
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    accuracy.paper_table.plot({"title": "t", "rows": rows}, tmp_path / "p.png")
    removed = [(x, y) for label, x, y in drawn if label.startswith("ours, measured effects removed")]
    assert removed == [([8], [80.75])]  # the median 79 with 1.75 points added back; the cell without effects not drawn


def test_the_unexplained_gaps_standard_error_adds_effects_and_both_medians_seed_noise():
    table = accuracy.paper_table
    rows = [
        {"accuracy": [70.0, 72.0]},  # variance 2, one degree of freedom
        {"accuracy": [80.0, 81.0, 82.0]},  # variance 1, two
        {"accuracy": [60.0]},  # one seed: no spread
    ]
    seed_std = table.pooled_seed_std(rows)
    assert seed_std == pytest.approx((4 / 3) ** 0.5)  # (1 * 2 + 2 * 1) / 3
    cell = {"accuracy": [75.0, 76.0], "explained": [{"points": -1.0, "se": 0.3}, {"points": -0.5, "se": 0.4}]}
    expected = (0.3**2 + 0.4**2 + (4 / 3) * (1 / 2 + 1 / table.PAPER_SEEDS)) ** 0.5
    assert table.left_standard_error(cell, seed_std) == pytest.approx(expected)
    # a partial error would read as a whole one: an effect without an SE, or no spread known, gives none
    assert table.left_standard_error({**cell, "explained": [{"points": -1.0}]}, seed_std) is None
    assert table.left_standard_error(cell, table.pooled_seed_std([{"accuracy": [60.0]}])) is None
