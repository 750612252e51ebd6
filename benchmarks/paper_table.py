"""A recipe table's results as a results-page summary (kind "paper_table") and its accuracy-vs-epsilon figure.

benchmarks/accuracy.py `table` trains the cells and calls summarize() on its run folders; the summary it
writes (OUT/summary.json) has the schema of benchmarks/results/summaries/cifar10_paper_table.json, so copying
it there updates docs/results.md. plot() draws the figure from a summary alone, so
benchmarks/make_results_page.py redraws the page's PNG from the committed JSON without any run folder.
"""

from __future__ import annotations

import datetime as _dt
import re
import shlex
import statistics
from pathlib import Path
from typing import Any

KIND = "paper_table"
PAPERS_SETTING = "paper's"


def run_name(cell: str, seed: int) -> str:
    """The folder of one seed of one cell."""
    return f"{cell}_seed{seed}"


def definition(table: Any) -> dict[str, Any]:
    """What the report needs of an equiconvert.recipes.table.Table, as JSON (kept in the output folder)."""
    return {
        "name": table.name,
        "source": table.source,
        "title": table.title,
        "description": table.description,
        "order": table.order,
        "figure": table.figure,
        "figure_title": table.figure_title,
        "notes": list(table.notes),
        "cells": [
            {
                "name": c.name,
                "model": c.model,
                "recipe": c.recipe,
                "set": list(c.overrides),
                "seeds": list(c.seeds),
                "epsilon": c.epsilon,
                "paper": c.paper,
            }
            for c in table.cells
        ],
    }


def cell_command(cell: dict[str, Any]) -> str:
    """The `equiconvert train` command of a cell's runs (data folder, output and devices left to the reader)."""
    args = ["--recipe", cell["recipe"], *(a for o in cell["set"] for a in ("--set", o))]
    return f"equiconvert train {shlex.join(args)} --seed {cell['seeds'][0] if len(cell['seeds']) == 1 else 'S'}"


def is_finished(result: dict[str, Any] | None) -> bool:
    """A run that trained all its requested steps (not stopped by a time limit or the privacy budget)."""
    if result is None or result.get("stopped_reason") is not None:
        return False
    steps, requested = result.get("steps"), result.get("requested_steps")
    return not (isinstance(steps, int) and isinstance(requested, int) and steps < requested)


def gpu_seconds(result: dict[str, Any], parts: list[dict[str, Any]]) -> float:
    """Wall time x processes over every `train` call of a run (a resumed run has one part per call)."""
    pieces = parts or [result]
    return sum(float(p.get("wall_time_s") or 0.0) * int(p.get("world_size") or 1) for p in pieces)


def _number(x: float | None) -> float | int | None:
    return None if x is None else int(x) if float(x).is_integer() else x


def _card(results: list[dict[str, Any]]) -> str:
    """'2 x NVIDIA H200' from result.json's device ('cuda:0 (NVIDIA H200)') and world size."""
    cards = set()
    for r in results:
        match = re.search(r"\((.*)\)", str(r.get("device", "")))
        cards.add(f"{r.get('world_size') or 1} x {match.group(1) if match else r.get('device', 'unknown')}")
    return "; ".join(sorted(cards)) or "no finished run yet"


def _setting(recorded: list[dict[str, Any]]) -> str:
    """The paper's settings, or the train arguments every run of the cell added to them."""
    added = sorted({shlex.join(r.get("pass_through") or []) for r in recorded})
    changes = [a for a in added if a]
    return PAPERS_SETTING if not changes else f"{PAPERS_SETTING} + " + " / ".join(changes)


def summarize(definition: dict[str, Any], runs: dict[str, dict[str, Any]], command: str | None) -> dict[str, Any]:
    """The paper_table summary of a table's run folders.

    runs: folder name -> {"result": result.json or None, "recorded": the benchmark's run record or None,
    "parts": one record per `train` call}. Only finished runs count in a row; the others are named in the notes.
    """
    rows, notes, finished_results, dates = [], [], [], []
    for cell in definition["cells"]:
        counted, recorded, seeds_run, seconds = [], [], [], 0.0
        for seed in cell["seeds"]:
            name = run_name(cell["name"], seed)
            run = runs.get(name, {})
            result, parts = run.get("result"), run.get("parts") or []
            if result is None:
                continue
            if not is_finished(result):
                notes.append(
                    f"{name}: stopped at step {result.get('steps')} of {result.get('requested_steps')} "
                    f"({result.get('stopped_reason') or 'fewer steps than requested'}); not counted until resumed."
                )
                continue
            counted.append(result)
            seeds_run.append(seed)
            recorded.append(run.get("recorded") or {})
            seconds += gpu_seconds(result, parts)
            dates += [p["finished"][:10] for p in parts if p.get("finished")]
            notes.append(
                f"{name}: {100 * result['test_accuracy']:.2f}%, epsilon {result.get('epsilon', float('nan')):.3f} "
                f"spent, {result.get('steps')} steps, {gpu_seconds(result, parts) / 3600:.3f} GPU-hours."
            )
        finished_results += counted
        params = sorted({r["params"] for r in counted if isinstance(r.get("params"), int)})
        rows.append(
            {
                "model": cell["model"],
                "epsilon": _number(cell["epsilon"]),
                "params": params[0] if len(params) == 1 else (params or None),
                "accuracy": [round(100 * r["test_accuracy"], 2) for r in counted],
                "gpu_hours": round(seconds / 3600, 3) if counted else None,
                "setting": _setting(recorded),
                "paper": cell["paper"],
                "command": cell_command(cell),
                "seeds": cell["seeds"],
                "seeds_run": seeds_run,
            }
        )
    today = _dt.datetime.now(_dt.timezone.utc).date().isoformat()
    summary: dict[str, Any] = {"kind": KIND}
    if definition.get("order") is not None:
        summary["order"] = definition["order"]
    summary.update(
        title=definition["title"],
        description=definition["description"],
        command=command or "not recorded",
        card=_card(finished_results),
        date=max(dates, default=today),
        rows=rows,
        notes=[*definition.get("notes", []), *notes],
    )
    if definition.get("figure"):
        summary["figure"] = {"path": definition["figure"], "title": definition.get("figure_title") or summary["title"]}
    return summary


def epsilon_axis(ax: Any, epsilons: list[float]) -> None:
    """An epsilon x-axis: log scale (when every epsilon is positive), ticked at the epsilons trained."""
    eps: list[float] = []
    for e in sorted(set(epsilons)):  # one tick for epsilons within 5% (8 and a recipe's 8.08 would overprint)
        if not eps or e > 1.05 * eps[-1]:
            eps.append(e)
    if eps and min(eps) > 0:
        ax.set_xscale("log")
    ax.set_xticks(eps, [f"{e:g}" for e in eps])
    ax.minorticks_off()
    ax.set_xlabel("epsilon")


def explained_points(row: dict[str, Any]) -> float:
    """The sum of a row's measured effects on its gap to the paper, in points (negative: they cost accuracy)."""
    return sum(effect["points"] for effect in row.get("explained", []))


PAPER_SEEDS = 5  # the paper's numbers are medians of five runs


def pooled_seed_std(rows: list[dict[str, Any]]) -> float | None:
    """The seed-to-seed standard deviation of one run, pooled over the rows with two or more seeds (points)."""
    runs = [r["accuracy"] for r in rows if len(r.get("accuracy") or []) > 1]
    freedom = sum(len(a) - 1 for a in runs)
    if not freedom:
        return None
    return (sum((len(a) - 1) * statistics.variance(a) for a in runs) / freedom) ** 0.5


def left_standard_error(row: dict[str, Any], seed_std: float | None) -> float | None:
    """The standard error of a row's unexplained gap: its effects' SEs, our median's and the paper's seed noise.

    Both medians are treated as means of their runs (seed_std / sqrt(runs)), the paper's runs assumed to spread
    like ours. None when an effect has no SE or no seed spread is known: a partial error would read as a full one.
    """
    effects = row.get("explained", [])
    if not effects or seed_std is None or any(e.get("se") is None for e in effects):
        return None
    variance = sum(e["se"] ** 2 for e in effects)
    variance += seed_std**2 * (1 / len(row["accuracy"]) + 1 / PAPER_SEEDS)
    return variance**0.5


Z_95 = 1.96  # two-sided 95% level of a normal error


def reading(left: float, se: float | None) -> str:
    """What a cell's unexplained part can carry at its SE: consistent with zero at the 95% level, or the points no
    measurement explains (or by which the estimates exceed the gap), in SEs. Never a threshold below the SE."""
    if se is None:
        return "-"
    if abs(left) < Z_95 * se:
        return "consistent with 0 (95%)"
    what = "unexplained" if left < 0 else "over-explained"
    return f"{abs(left):.2f} points {what} ({abs(left) / se:.1f} SE)"


def with_analysis(row: dict[str, Any], analysis: dict[str, Any]) -> dict[str, Any]:
    """The row with its effects counted as `analysis` counts them.

    The effects whose name starts with analysis["effect"] give way to the analysis' value: per epsilon
    ("by_epsilon", keyed by the rounded epsilon), or one for every row ("all"); null drops them. Rows of other models
    than analysis["models"] (when given) keep their effects."""
    if row["model"] not in analysis.get("models", [row["model"]]):
        return row
    kept = [e for e in row.get("explained", []) if not e["effect"].startswith(analysis["effect"])]
    if "by_epsilon" in analysis:
        value = analysis["by_epsilon"].get(f"{round(float(row['epsilon'])):g}")
    else:
        value = analysis["all"]
    if value is not None:
        kept.append({"effect": analysis["effect"], "source": analysis["name"], **value})
    return {**row, "explained": kept}


def shared_effect(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The one measured effect every explained row counts with the same points and SE (the JPEG estimate): its error
    moves every row's unexplained part together."""
    explained = [r["explained"] for r in rows if r.get("explained")]
    if not explained:
        return None
    common = [e for e in explained[0] if all(any(e == f for f in effects) for effects in explained[1:])]
    return common[0] if common else None


def plot(summary: dict[str, Any], path: Path) -> None:
    """Test accuracy vs epsilon: our median per cell (bars: min-max over seeds), the same with the cell's measured
    effects removed (hollow, dashed) where it has any, and the paper's points beside them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    drawn_paper_points: set[tuple[float, float]] = set()  # a paper number two rows compare with is drawn once
    fig, ax = plt.subplots(figsize=(7.0, 4.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, model in enumerate(dict.fromkeys(r["model"] for r in rows)):
        color = colors[i % len(colors)]
        mine = sorted((r for r in rows if r["model"] == model), key=lambda r: r["epsilon"])
        ours = [r for r in mine if r["accuracy"]]
        if ours:
            med = [statistics.median(r["accuracy"]) for r in ours]
            err = [
                [m - min(r["accuracy"]) for m, r in zip(med, ours)],
                [max(r["accuracy"]) - m for m, r in zip(med, ours)],
            ]
            ax.errorbar(
                [r["epsilon"] for r in ours], med, yerr=err, marker="o", capsize=3, color=color, label=f"ours: {model}"
            )
            corrected = [(r["epsilon"], m - explained_points(r)) for m, r in zip(med, ours) if r.get("explained")]
            if corrected:
                ax.plot(
                    *zip(*corrected),
                    marker="o",
                    markerfacecolor="none",
                    linestyle="--",
                    color=color,
                    label=f"ours, measured effects removed: {model}",
                )
        paper = [
            r
            for r in mine
            if r.get("paper") is not None and (r["paper"], round(r["epsilon"])) not in drawn_paper_points
        ]
        drawn_paper_points.update((r["paper"], round(r["epsilon"])) for r in paper)
        if paper:
            ax.plot(
                [r["epsilon"] for r in paper],
                [r["paper"] for r in paper],
                marker="x",
                markersize=8,
                linestyle=":",
                color=color,
                label=f"paper: {model}",
            )
    epsilon_axis(ax, [r["epsilon"] for r in rows])
    ax.set_ylabel("test accuracy (%); bars: min-max over seeds")
    ax.set_title(summary.get("figure", {}).get("title") or summary["title"], fontsize=9)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # ours before the paper's
        order = sorted(range(len(labels)), key=lambda i: not labels[i].startswith("ours"))
        ax.legend(  # below the axes: a dozen entries would hide the curves
            [handles[i] for i in order], [labels[i] for i in order], fontsize=8, loc="upper center",
            bbox_to_anchor=(0.5, -0.15), ncol=1,
        )  # fmt: skip
    fig.savefig(path, dpi=100, metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)
