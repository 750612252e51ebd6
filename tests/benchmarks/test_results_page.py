"""The results page (docs/results.md) is generated from benchmarks/results/summaries/*.json and must match them."""

from __future__ import annotations

import importlib.util
import json
import statistics

import pytest

from tests.support.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "benchmarks" / "make_results_page.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_results_page", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_is_up_to_date(tmp_path):
    page = _load_script()
    out = tmp_path / "results.md"
    assert page.main(["--out", str(out)]) == 0
    assert out.read_text() == (REPO_ROOT / "docs" / "results.md").read_text(), (
        "docs/results.md is out of date: run python benchmarks/make_results_page.py"
    )
    assert page.main(["--check"]) == 0


def test_every_summary_names_command_card_and_date():
    for path in sorted((REPO_ROOT / "benchmarks" / "results" / "summaries").glob("*.json")):
        summary = json.loads(path.read_text())
        for key in ("title", "kind", "card", "date", "rows"):
            assert summary.get(key), f"{path.name} has no {key}"
        commands = [summary.get("command")] + [row.get("command") for row in summary["rows"]]
        assert any(commands), f"{path.name} names no command"


def test_medians_and_rates_are_computed_from_the_data(tmp_path):
    page = _load_script()
    summary = {
        "kind": "seeds",
        "title": "T",
        "description": "D",
        "card": "C",
        "date": "2026-01-01",
        "command": "x",
        "columns": ["model", "params", "s0", "s1", "s2", "median"],
        "rows": [{"model": "m", "params": 1000, "accuracy": [90.0, 80.0, 85.0]}],
    }
    (tmp_path / "a.json").write_text(json.dumps(summary))
    text = page.render_page(page.load_summaries(tmp_path))
    assert "| m | 1,000 | 90.00% | 80.00% | 85.00% | **85.00%** |" in text
    thr = {
        "kind": "throughput",
        "samples_per_step": 2048,
        "paper_code_samples_per_s": 12100,
        "rows": [{"precision": "bf16", "nonprivate_ms": 34.3, "dp_ms": 48.5, "peak_memory_gib": [6.0, 7.2]}],
    }
    row = page.RENDERERS["throughput"](thr)[2]
    assert "1.41x" in row and "42.2k" in row and "3.49x" in row and "(1.20x)" in row


def test_unknown_kind_and_empty_folder_are_refused(tmp_path):
    page = _load_script()
    with pytest.raises(FileNotFoundError, match="no JSON summaries"):
        page.load_summaries(tmp_path)
    with pytest.raises(ValueError, match="known kinds"):
        page.render_section({"kind": "nope", "title": "T"})
    stale = tmp_path / "stale.md"
    stale.write_text("old\n")
    assert page.main(["--check", "--out", str(stale)]) == 1


def _tables(text: str) -> list[list[str]]:
    """The markdown tables of a page, each as its lines."""
    tables, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    return tables


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split(" | ")]


def test_the_page_opens_with_the_headline_table():
    page = _load_script()
    text = (REPO_ROOT / "docs" / "results.md").read_text()
    first = _tables(text)[0]
    before = text[: text.index(first[0])]
    assert [line for line in before.splitlines() if line.startswith("#")] == ["# Results", "## Headline"]
    assert _cells(first[0]) == page.HEADLINE_COLUMNS
    paper_table = json.loads(
        (REPO_ROOT / "benchmarks" / "results" / "summaries" / "cifar10_paper_table.json").read_text()
    )
    quoted = [row for row in paper_table["rows"] if row.get("paper")]
    rows = [_cells(line) for line in first[2:]]
    # one run's seed spread, pooled over the rows with several seeds: the paper table has two such rows
    spread = [row["accuracy"] for row in paper_table["rows"] if len(row["accuracy"]) > 1]
    assert len(spread) >= 2
    seed_variance = sum(statistics.variance(a) * (len(a) - 1) for a in spread) / sum(len(a) - 1 for a in spread)
    assert [(r[0], r[3]) for r in rows] == [(row["model"], f"{row['paper']:.2f}%") for row in quoted]
    for r, row in zip(rows, quoted):  # ours, and the gap to the paper in points
        ours = statistics.median(row["accuracy"])
        assert r[2] == f"**{ours:.2f}%** ({len(row['accuracy'])})" and r[4] == f"{ours - row['paper']:+.2f}"
        if row.get("explained"):  # the measured causes summed, and what they leave of the gap
            explained = sum(effect["points"] for effect in row["explained"])
            # its SE: the effects' SEs and the seed noise of our median and of the paper's median of five runs
            variance = sum(e["se"] ** 2 for e in row["explained"])
            variance += seed_variance * (1 / len(row["accuracy"]) + 1 / 5)
            left = f"{ours - row['paper'] - explained:+.2f} ({variance**0.5:.2f})"
            assert r[5] == f"{explained:+.2f}" and r[6] == left
        else:
            assert r[5] == r[6] == "-"


def test_no_table_is_wider_than_the_page():
    page = _load_script()
    text = (REPO_ROOT / "docs" / "results.md").read_text()
    wide = [table[0] for table in _tables(text) if len(_cells(table[0])) > page.MAX_COLUMNS]
    assert len(_tables(text)) > 10 and not wide, wide
    with pytest.raises(ValueError, match=f"a table of {page.MAX_COLUMNS + 1} columns .* does not fit the page"):
        page._table([f"c{i}" for i in range(page.MAX_COLUMNS + 1)], [])


def test_init_scale_tables_put_the_original_first_with_medians_per_setting():
    page = _load_script()

    def row(group, on, stds, losses, sweep):
        return {"group": group, "unit_invariants": on, "logit_std_runs": stds, "loss_runs": losses, "sweep": sweep}

    ran = {"0.05": {"loss": 0.4, "accuracy": 80.0}, "0.2": {"loss": None, "accuracy": 9.5}}
    summary = {
        "kind": "init_scale",
        "lrs": [0.05, 0.2],
        "rows": [
            row("O2", True, [0.7, 0.9, 0.8], [2.5, 2.6, 2.4], ran),
            row("original", True, [0.8, 0.1, 0.9], [2.7, 2.9, 2.8], {"0.05": {"loss": 0.3, "accuracy": 89.1}}),
            row("O2", False, [3.0, 3.2, 3.1], [5.6, 5.7, 5.8], ran),
        ],
    }
    lines = page.RENDERERS["init_scale"](summary)
    on, off = lines.index("Unit invariants on (the default):"), lines.index(next(x for x in lines if "off" in x))
    assert lines[on + 2] == "| group | logit std | initial loss | accuracy, lr 0.05 | accuracy, lr 0.2 |"
    assert lines[on + 4 : on + 6] == [
        "| original | 0.80 | 2.80 | 89.10% | - |",
        "| O2 | 0.80 | 2.50 | 80.00% | 9.50% (diverged) |",
    ]
    assert lines[off + 4 :] == ["| O2 | 3.10 | 5.70 | 80.00% | 9.50% (diverged) |"]


def test_the_paper_tables_paired_effects_are_their_rows_differences_with_the_pooled_pair_se():
    """A paired effect's points are its preset run minus the paired row's run, its SE the difference of two runs."""
    paper_table = json.loads(
        (REPO_ROOT / "benchmarks" / "results" / "summaries" / "cifar10_paper_table.json").read_text()
    )
    rows = paper_table["rows"]
    spread = [row["accuracy"] for row in rows if len(row["accuracy"]) > 1]
    pooled = (sum(statistics.variance(a) * (len(a) - 1) for a in spread) / sum(len(a) - 1 for a in spread)) ** 0.5
    by_name = {(row["model"], row["epsilon"]): row for row in rows}
    checked = 0
    for row in rows:
        for effect in row.get("explained", []):
            if "(paired, seed " not in effect["source"]:
                continue
            model = effect["source"].split("'")[1]
            seed = int(effect["source"].split("(paired, seed ")[1].rstrip(")"))
            paired = by_name[(model, row["epsilon"])]
            preset = row["accuracy"][row["seeds"].index(seed)]
            assert paired["seeds"] == [seed], effect["source"]
            assert effect["points"] == pytest.approx(preset - paired["accuracy"][0], abs=0.005), effect["source"]
            assert effect["se"] == pytest.approx(pooled * 2**0.5, abs=0.005), effect["source"]
            checked += 1
    assert checked == 4  # epsilon 8: bf16 and EMA; epsilon 4 and 3: EMA


def test_the_headline_says_what_each_left_can_carry_and_counts_it_under_the_other_analyses():
    page = _load_script()
    import paper_table  # the generator put benchmarks/ on the path

    assert paper_table.reading(-0.43, 0.68) == "consistent with 0 (95%)"
    assert paper_table.reading(-1.72, 0.54) == "1.72 points unexplained (3.2 SE)"
    assert paper_table.reading(1.2, 0.5) == "1.20 points over-explained (2.4 SE)"
    jpeg = {"effect": "JPEG copy, estimated", "points": -1.5, "se": 0.4, "source": "s"}
    ema = {"effect": "EMA per step", "points": -0.3, "se": 0.5, "source": "s"}
    row = {"model": "m", "epsilon": 8.08, "accuracy": [77.5, 78.5], "paper": 81.0, "explained": [jpeg, ema]}
    per_epsilon = {
        "name": "J",
        "description": "d",
        "effect": "JPEG copy",
        "by_epsilon": {"8": {"points": -1.6, "se": 0.45}},
    }
    assert paper_table.with_analysis(row, per_epsilon)["explained"] == [
        ema,
        {"effect": "JPEG copy", "source": "J", "points": -1.6, "se": 0.45},
    ]
    assert paper_table.with_analysis(row, {"name": "N", "effect": "EMA", "all": None})["explained"] == [jpeg]
    assert paper_table.with_analysis(row, {"name": "O", "effect": "EMA", "all": None, "models": ["x"]}) == row
    assert paper_table.shared_effect([row, {**row, "explained": [jpeg]}, {"explained": None}]) == jpeg

    summary = {"title": "T", "rows": [row, {**row, "model": "n", "explained": [jpeg]}], "analyses": [per_epsilon]}
    text = "\n".join(page._headline(summary))
    head, analyses = _tables(text)
    # left: -3 + 1.5 (+ 0.3); SE: the effects' and the seed noise of two runs and of the paper's five (std 0.71)
    assert _cells(head[2])[6:] == ["-1.20 (0.87)", "consistent with 0 (95%)"]
    assert _cells(head[3])[6:] == ["-1.50 (0.71)", "1.50 points unexplained (2.1 SE)"]
    assert _cells(analyses[0]) == ["model", "epsilon", "this page", "J"]
    assert _cells(analyses[2])[2:] == ["-1.20 (0.87)", "-1.10 (0.90)"]
    assert _cells(analyses[3])[2:] == ["-1.50 (0.71) *", "-1.40 (0.74)"]  # '*': 1.96 SE or more from zero
    assert "'JPEG copy, estimated' (-1.50, SE 0.40), is the same number in every explained row" in text


def test_the_released_code_comparison_renders_each_run_and_the_difference_with_its_se():
    page = _load_script()
    row = {"steps": 200, "requested_steps": 200, "stopped_reason": None, "epsilon": 7.99, "wall_time_s": 300.0}
    rows = [
        {**row, "arm": "preset", "seed": 0, "test_accuracy": 60.0},
        {**row, "arm": "released", "seed": 0, "test_accuracy": 62.5},
        {**row, "arm": "released", "seed": 1, "test_accuracy": 61.0, "stopped_reason": "time_limit", "steps": 90},
    ]
    summary = {
        "rows": rows,
        "arms": {"released": {"n": 1, "mean": 62.5, "se": None}, "preset": {"n": 1, "mean": 60.0, "se": None}},
        "released_minus_preset": {"points": 2.5, "se": 0.5, "in_se": 5.0},
        "runs_without_result": ["preset_seed1"],
    }
    lines = page.RENDERERS["released_vs_preset"](summary)
    table = [_cells(line) for line in lines if line.startswith("|")]
    assert table[2] == ["released code", "0", "62.50%", "7.99", "200 of 200", "300 s"]
    assert table[3][2] == "61.00% (stopped: time_limit)" and table[3][4] == "90 of 200"
    assert "- released code minus preset: +2.50 points (SE 0.50, +5.0 SE)" in lines
    assert "- our released-settings preset: 60.00% over 1 finished runs" in lines
    assert "- runs without a result (failed; logs in their run folders): preset_seed1" in lines  # none dropped
