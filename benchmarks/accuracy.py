"""Accuracy benchmark: the paper's table (test accuracy vs epsilon, per group) for any model.

    .venv/bin/python benchmarks/accuracy.py run --dataset fashion-mnist --model equiconvert:resnet9 \\
        --groups none,D1,D4 --epsilons 1,3,8 --seeds 0,1,2 --out benchmarks/results/accuracy/NAME \\
        [--data-dir DIR] [--devices cuda:0,cuda:1 --jobs-per-device 2] -- --steps 1000 --batch-size 2048
    .venv/bin/python benchmarks/accuracy.py report --out benchmarks/results/accuracy/NAME
    .venv/bin/python benchmarks/accuracy.py table cifar10_paper --data-dir DIR --out runs/cifar10_paper \\
        --nproc-per-node 4 [--time-limit SECONDS] [--cells d4_eps8,...] -- --set dp.precision=bf16

`run` trains nothing itself: every (group, epsilon, seed) of the grid is one subprocess
`python -m equiconvert train ... --out OUT/<run-name>` with the arguments after `--` passed through
verbatim, so every run uses the same schedule. Runs go in parallel over device slots (each device
listed in --devices, --jobs-per-device times). A run whose result.json exists is skipped, one with a
checkpoint.pt but no result.json is continued with --resume, so an interrupted grid resumes where it
stopped. Each run's stdout/stderr goes to OUT/<run-name>/stdout.log. A failed run does not stop the
others; it is reported at the end (name and the last lines of its log) and the exit status is 1.

`report` (also the last step of `run`) reads OUT/*/result.json, groups the runs by (dataset, model,
group, epsilon) and writes OUT/summary.json, OUT/table.md (median ± std over seeds, in percent, with
parameters and wall time; for runs trained with `--test-shifts SET`, a second table of the shift-averaged
accuracy) and OUT/accuracy_vs_epsilon.png. Runs that stopped before the requested
number of steps (privacy budget, time limit) are marked in the table, never mixed in silently.

`table NAME|FILE` trains the cells of a recipe table (equiconvert/recipes/tables/*.toml) on N GPUs and
reports them in the results page's format: benchmarks/recipe_table.py. Both run `train` through
benchmarks/train_runs.py.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import queue
import re
import statistics
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, also when loaded by path
import paper_table  # noqa: E402
import recipe_table  # noqa: E402
from train_runs import (  # noqa: E402
    RUN_FILE,
    Printer,
    check_extra_args,
    execute,
    invocations,
    log_invocation,
    plan,
    print_failures,
    read_json,
    shown_command,
    split_list,
    utc_now,
)

BASELINE = "none"
BASELINE_LABEL = "none (unconverted)"
# result.json fields that, when set, say why a run stopped before its requested steps.
STOP_FIELDS = ("stopped_reason", "stop_reason")
REQUESTED_STEP_FIELDS = ("requested_steps", "steps_requested", "target_steps")
EARLY_MARK = "†"
SHIFT_AVERAGED = "test_accuracy_shift_averaged"  # result.json of a `train --test-shifts SET` run


# --- the grid ------------------------------------------------------------------------------------


def _fmt_eps(epsilon: float) -> str:
    return f"{epsilon:g}"


def run_name(dataset: str, model: str, group: str, epsilon: float, seed: int) -> str:
    """A folder name for one run: letters, digits, '.', '_' and '-' only."""
    raw = f"{dataset}_{model}_{group}_eps{_fmt_eps(epsilon)}_seed{seed}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", raw)


@dataclass(frozen=True)
class Run:
    dataset: str
    model: str
    group: str
    epsilon: float
    seed: int

    @property
    def name(self) -> str:
        return run_name(self.dataset, self.model, self.group, self.epsilon, self.seed)

    @property
    def fixed_args(self) -> tuple[str, ...]:
        """Train arguments of this run beyond the pass-through ones that define it (a grid's are in its name)."""
        return ()


def build_grid(dataset: str, model: str, groups: list[str], epsilons: list[float], seeds: list[int]) -> list[Run]:
    runs = [Run(dataset, model, g, e, s) for g in groups for e in epsilons for s in seeds]
    names = [r.name for r in runs]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise SystemExit(f"error: the grid gives the same run name twice: {', '.join(clashes)}")
    return runs


def train_command(
    run: Run, out_dir: Path, device: str, data_dir: str | None, extra: list[str], resume: bool
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "equiconvert",
        "train",
        "--model",
        run.model,
        "--group",
        run.group,
        "--dataset",
        run.dataset,
    ]
    if data_dir is not None:
        cmd += ["--data-dir", data_dir]
    cmd += [
        "--epsilon",
        _fmt_eps(run.epsilon),
        "--seed",
        str(run.seed),
        "--out",
        str(out_dir),
        "--set",
        "run.progress=false",
        *extra,
        "--device",
        device,
    ]
    return cmd + (["--resume"] if resume else ["--overwrite"])  # a start replaces what a killed start left


def _grid_job(
    run: Run, out: Path, device: str, data_dir: str | None, extra: list[str], resume: bool, say: Printer
) -> dict | None:
    cmd = train_command(run, out / run.name, device, data_dir, extra, resume)
    record = {
        "run": run.name,
        "dataset": run.dataset,
        "model": run.model,
        "group": run.group,
        "epsilon": run.epsilon,
        "seed": run.seed,
        "device": device,
        "extra_args": extra,
    }
    return execute(run.name, out / run.name, cmd, record, resume, say, device)


def run_grid(args: argparse.Namespace, extra: list[str], argv: list[str]) -> int:
    check_extra_args(extra)
    groups, epsilons, seeds = (
        split_list(args.groups),
        [float(e) for e in split_list(args.epsilons)],
        [int(s) for s in split_list(args.seeds)],
    )
    devices = split_list(args.devices)
    if not groups or not epsilons or not seeds or not devices or args.jobs_per_device < 1:
        raise SystemExit(
            "error: --groups, --epsilons, --seeds and --devices need at least one value, --jobs-per-device at least 1"
        )
    out = Path(args.out)
    runs = build_grid(args.dataset, args.model, groups, epsilons, seeds)
    done, to_resume, to_start = plan(runs, out, extra, args.continue_stopped)
    out.mkdir(parents=True, exist_ok=True)
    log_invocation(
        out, __file__, argv, devices=devices, groups=groups, epsilons=epsilons, seeds=seeds, extra_args=extra
    )
    print(
        f"{len(runs)} runs: {len(done)} done (skipped), {len(to_resume)} to resume, {len(to_start)} to start; "
        f"{len(devices) * args.jobs_per_device} at a time on {', '.join(devices)}",
        flush=True,
    )

    slots: queue.Queue[str] = queue.Queue()
    for _ in range(args.jobs_per_device):
        for device in devices:
            slots.put(device)
    say = Printer(len(to_resume) + len(to_start))

    def job(run: Run, resume: bool) -> dict | None:
        device = slots.get()
        try:
            return _grid_job(run, out, device, args.data_dir, extra, resume, say)
        except Exception as exc:  # the benchmark's own error (disk, permissions): still one failed run
            return {"run": run.name, "why": f"{type(exc).__name__}: {exc}", "log": "", "tail": ""}
        finally:
            slots.put(device)

    work = [(r, True) for r in to_resume] + [(r, False) for r in to_start]
    with ThreadPoolExecutor(max_workers=slots.qsize()) as pool:
        failures = [f for f in pool.map(lambda item: job(*item), work) if f is not None]

    report(out, argv=argv)
    return 1 if print_failures(failures, len(work)) else 0


# --- recipe tables -------------------------------------------------------------------------------


# --- the report ----------------------------------------------------------------------------------


def _requested_steps(result: dict, recorded: dict | None) -> int | None:
    for field in REQUESTED_STEP_FIELDS:
        if isinstance(result.get(field), int):
            return result[field]
    extra = (recorded or {}).get("extra_args", [])
    for i, arg in enumerate(extra):
        if arg == "--steps" and i + 1 < len(extra):
            return int(extra[i + 1])
        if arg.startswith("--steps="):
            return int(arg.split("=", 1)[1])
    return None


def _stop_reason(run_dir: Path, result: dict) -> str | None:
    for field in STOP_FIELDS:
        if field in result:  # train's own answer (None: ran to the end); the log may hold a resumed run's old stop
            return None if result[field] is None else str(result[field])
    try:
        lines = (run_dir / "log.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "stopped":
            return str(event.get("reason", "stopped"))
    return None


def load_runs(out: Path) -> list[dict]:
    """Every OUT/*/result.json, with its run name, seed and early-stop information added."""
    runs = []
    for path in sorted(out.glob("*/result.json")):
        result = read_json(path)
        if not isinstance(result, dict) or "test_accuracy" not in result:
            print(f"warning: skipping {path}: not a result record", file=sys.stderr)
            continue
        recorded = read_json(path.parent / RUN_FILE)
        requested = _requested_steps(result, recorded)
        reason = _stop_reason(path.parent, result)
        steps = result.get("steps")
        if reason is None and requested is not None and isinstance(steps, int) and steps < requested:
            reason = "fewer steps than requested"
        runs.append(
            {
                **result,
                "run": path.parent.name,
                "seed": result.get("seed", (recorded or {}).get("seed")),
                "target_epsilon": result.get("target_epsilon", (recorded or {}).get("epsilon")),
                "requested_steps": requested,
                "stopped_early": reason,
                "finished": _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.timezone.utc).date().isoformat(),
            }
        )
    return runs


def _common(values: list):
    """The value if all runs agree, else the sorted distinct values (so a mix is visible)."""
    distinct = sorted({json.dumps(v) for v in values})
    return json.loads(distinct[0]) if len(distinct) == 1 else [json.loads(v) for v in distinct]


def _group_key(group: str) -> tuple:
    if group.lower() == BASELINE:
        return (0, "", 0, group)
    match = re.fullmatch(r"([A-Za-z]+)(\d*)", group)
    return (1, match.group(1), int(match.group(2) or 0), group) if match else (2, group, 0, group)


def summarize(runs: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["dataset"], r["model"], r["group"], r["target_epsilon"]), []).append(r)
    summary = []
    for (dataset, model, group, epsilon), members in sorted(
        cells.items(), key=lambda item: (item[0][0], item[0][1], _group_key(item[0][2]), item[0][3] or 0)
    ):
        members.sort(key=lambda r: (r["seed"] is None, r["seed"], r["run"]))
        acc = [r["test_accuracy"] for r in members]
        averaged = [r for r in members if isinstance(r.get(SHIFT_AVERAGED), (int, float))]
        summary.append(
            {
                "dataset": dataset,
                "model": model,
                "group": group,
                "epsilon": epsilon,
                "n": len(members),
                "accuracy_median": statistics.median(acc),
                "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else None,  # sample std (n - 1)
                "accuracy_min": min(acc),
                "accuracy_max": max(acc),
                "brier_median": _median(members, "brier"),
                "ece_median": _median(members, "ece"),
                # `train --test-shifts SET` runs: the same statistics of the shift-averaged accuracy, over the runs that have it
                "test_shifts": _common([r.get("test_shifts") for r in averaged]) if averaged else None,
                "shift_averaged_n": len(averaged),
                "shift_averaged_accuracy_median": _median(averaged, SHIFT_AVERAGED),
                "shift_averaged_accuracy_std": statistics.stdev(r[SHIFT_AVERAGED] for r in averaged)
                if len(averaged) > 1
                else None,
                "epsilon_spent_max": max((r.get("epsilon", math.nan) for r in members), default=None),
                "delta": _common([r.get("delta") for r in members]),
                "params": _common([r.get("params") for r in members]),
                "params_before": _common([r.get("params_before") for r in members]),
                "wall_time_s_median": _median(members, "wall_time_s"),
                "device": _common([r.get("device") for r in members]),
                "steps": _common([r.get("steps") for r in members]),
                "requested_steps": _common([r["requested_steps"] for r in members]),
                "batch_size": _common([r.get("batch_size") for r in members]),
                "aug_mult": _common([r.get("aug_mult") for r in members]),
                "stopped_early": [
                    {
                        "run": r["run"],
                        "steps": r.get("steps"),
                        "requested_steps": r["requested_steps"],
                        "reason": r["stopped_early"],
                    }
                    for r in members
                    if r["stopped_early"]
                ],
                "runs": [
                    {
                        "run": r["run"],
                        "seed": r["seed"],
                        "test_accuracy": r["test_accuracy"],
                        SHIFT_AVERAGED: r.get(SHIFT_AVERAGED),
                        "brier": r.get("brier"),
                        "ece": r.get("ece"),
                        "epsilon": r.get("epsilon"),
                        "steps": r.get("steps"),
                        "wall_time_s": r.get("wall_time_s"),
                        "device": r.get("device"),
                        "finished": r["finished"],
                    }
                    for r in members
                ],
            }
        )
    return summary


def _median(runs: list[dict], field: str):
    values = [r[field] for r in runs if isinstance(r.get(field), (int, float))]
    return statistics.median(values) if values else None


def _eps_label(epsilon) -> str:
    return "–" if epsilon is None else _fmt_eps(epsilon)


def _fmt_time(seconds) -> str:
    if seconds is None:
        return "–"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def _fmt_value(value) -> str:
    if isinstance(value, list):
        return "mixed: " + ", ".join(_fmt_value(v) for v in value)
    if isinstance(value, int):
        return f"{value:,}"
    return "–" if value is None else str(value)


def _cell_text(cell: dict, prefix: str = "accuracy", count: str = "n") -> str:
    """median ± std (seeds) of the cell's `prefix`_median / _std, marked when a run stopped early."""
    if cell[f"{prefix}_median"] is None:
        return "–"
    std = "–" if cell[f"{prefix}_std"] is None else f"{100 * cell[f'{prefix}_std']:.2f}"
    mark = f" {EARLY_MARK}" if cell["stopped_early"] else ""
    return f"{100 * cell[f'{prefix}_median']:.2f} ± {std} ({cell[count]}){mark}"


def _header_lines(cells: list[dict], runs: list[dict], commands: list[dict]) -> list[str]:
    dataset, model = cells[0]["dataset"], cells[0]["model"]
    # train writes e.g. "cuda:0 (NVIDIA H100 80GB HBM3)"
    shown = ", ".join(
        sorted({str(d) for c in cells for d in (c["device"] if isinstance(c["device"], list) else [c["device"]])})
    )
    finished = sorted(r["finished"] for r in runs)
    dates = finished[0] if finished[0] == finished[-1] else f"{finished[0]} to {finished[-1]}"

    def setting(field: str) -> str:
        return _fmt_value(_common([c[field] for c in cells]))

    requested = (
        "" if all(c["requested_steps"] is None for c in cells) else f" of {setting('requested_steps')} requested"
    )
    lines = [
        f"dataset: {dataset} · model: {model} · delta: {setting('delta')} · device: {shown} · "
        f"runs finished: {dates} (UTC)",
        f"steps: {setting('steps')}{requested} · batch size: {setting('batch_size')} · aug mult: {setting('aug_mult')}",
    ]
    for c in commands:
        lines.append(
            f"command ({c.get('date', '?')}, commit {(c.get('git_commit') or 'unknown')[:10]}): `{c['command']}`"
        )
    if not commands:
        lines.append("command: not recorded")
    return lines


def _epsilon_table(groups: list[str], epsilons: list, by: dict, text: Callable[[dict], str]) -> list[str]:
    """Markdown rows (group x epsilon) of text(cell); "–" where a group has no run at that epsilon."""
    lines = [
        "| group | " + " | ".join(f"ε = {_eps_label(e)}" for e in epsilons) + " |",
        "|---|" + "---:|" * len(epsilons),
    ]
    for group in groups:
        label = BASELINE_LABEL if group.lower() == BASELINE else group
        cells = [by.get((group, e)) for e in epsilons]
        lines.append(f"| {label} | " + " | ".join("–" if c is None else text(c) for c in cells) + " |")
    return lines


def markdown(summary: list[dict], runs: list[dict], commands: list[dict]) -> str:
    out = ["# Accuracy benchmark", ""]
    for dataset, model in dict.fromkeys((c["dataset"], c["model"]) for c in summary):
        cells = [c for c in summary if (c["dataset"], c["model"]) == (dataset, model)]
        mine = [r for r in runs if (r["dataset"], r["model"]) == (dataset, model)]
        epsilons = sorted({c["epsilon"] for c in cells}, key=lambda e: (e is None, e))
        groups = sorted({c["group"] for c in cells}, key=_group_key)
        by = {(c["group"], c["epsilon"]): c for c in cells}
        out += [f"## {dataset}, {model}", ""]
        out += [line + "  " for line in _header_lines(cells, mine, commands)]
        out += ["", "Test accuracy (%), median ± std (number of seeds); std is the sample standard deviation.", ""]
        out.append(
            "| group | params | "
            + " | ".join(f"ε = {_eps_label(e)}" for e in epsilons)
            + " | wall time / run (median) |"
        )
        out.append("|---|---:|" + "---:|" * len(epsilons) + "---:|")
        for group in groups:
            row = [by.get((group, e)) for e in epsilons]
            present = [c for c in row if c is not None]
            label = BASELINE_LABEL if group.lower() == BASELINE else group
            wall = _median([r for r in mine if r["group"] == group], "wall_time_s")
            out.append(
                f"| {label} | {_fmt_value(_common([c['params'] for c in present]))} | "
                + " | ".join("–" if c is None else _cell_text(c) for c in row)
                + f" | {_fmt_time(wall)} |"
            )
        if any(c["shift_averaged_n"] for c in cells):
            shifts = _fmt_value(_common([c["test_shifts"] for c in cells if c["shift_averaged_n"]]))
            out += [
                "",
                f"Test accuracy (%) of the softmax averaged over each test image's shifted copies "
                f"(`--test-shifts {shifts}`: post-processing, no privacy cost), median ± std (number of seeds):",
                "",
            ]
            out += _epsilon_table(
                groups, epsilons, by, lambda c: _cell_text(c, "shift_averaged_accuracy", "shift_averaged_n")
            )
        out += ["", "Brier score (median over seeds):", ""]
        out += _epsilon_table(
            groups, epsilons, by, lambda c: "–" if c["brier_median"] is None else f"{c['brier_median']:.4f}"
        )
        early = [s for c in cells for s in c["stopped_early"]]
        if early:
            out += ["", f"{EARLY_MARK} includes runs that stopped before the requested steps:"]
            out += [
                f"- {s['run']}: {s['steps']} of {_fmt_value(s['requested_steps'])} steps ({s['reason']})" for s in early
            ]
        out.append("")
    return "\n".join(out)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((c["dataset"], c["model"]) for c in summary)) or [("", "")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (dataset, model) in zip(axes[0], panels):
        cells = [c for c in summary if (c["dataset"], c["model"]) == (dataset, model)]
        for group in sorted({c["group"] for c in cells}, key=_group_key):
            line = sorted((c for c in cells if c["group"] == group), key=lambda c: c["epsilon"])
            eps = [c["epsilon"] for c in line]
            med = [100 * c["accuracy_median"] for c in line]
            err = [
                [m - 100 * c["accuracy_min"] for m, c in zip(med, line)],
                [100 * c["accuracy_max"] - m for m, c in zip(med, line)],
            ]
            label = BASELINE_LABEL if group.lower() == BASELINE else group
            ax.errorbar(eps, med, yerr=err, marker="o", capsize=3, label=label)
        paper_table.epsilon_axis(ax, [c["epsilon"] for c in cells])
        ax.set_ylabel("test accuracy (%), median; bars: min-max over seeds")
        ax.set_title(f"{dataset}, {model}")
        ax.grid(alpha=0.3)
        if cells:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(out: Path, argv: list[str] | None = None) -> dict:
    if (out / recipe_table.TABLE_FILE).exists():
        return recipe_table.table_report(out)
    runs = load_runs(out)
    commands = invocations(out)
    summary = summarize(runs)
    document = {
        "generated": utc_now(),
        "report_command": shown_command(__file__, argv) if argv is not None else None,
        "commands": commands,
        "runs": len(runs),
        "cells": summary,
    }
    (out / "summary.json").write_text(json.dumps(document, indent=2))
    (out / "table.md").write_text(
        markdown(summary, runs, commands) if summary else "# Accuracy benchmark\n\nno finished runs\n"
    )
    plot(summary, out / "accuracy_vs_epsilon.png")
    print(
        f"report: {len(runs)} runs in {len(summary)} cells -> {out / 'table.md'}, {out / 'summary.json'}, "
        f"{out / 'accuracy_vs_epsilon.png'}",
        flush=True,
    )
    return document


# --- entry point ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accuracy.py",
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after `--` go verbatim to every `equiconvert train`.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the grid (skipping finished runs), then report")
    run.add_argument("--dataset", required=True)
    run.add_argument("--data-dir", default=None, help="passed to train as --data-dir (omitted if not given)")
    run.add_argument("--model", default="equiconvert:resnet9")
    run.add_argument("--groups", required=True, help="comma-separated, 'none' = the unconverted baseline")
    run.add_argument("--epsilons", required=True, help="comma-separated target epsilons")
    run.add_argument("--seeds", default="0,1,2")
    run.add_argument("--out", required=True, help="folder of the grid: one sub-folder per run, plus the report")
    run.add_argument("--devices", default="cpu", help="comma-separated train --device values (default cpu)")
    run.add_argument("--jobs-per-device", type=int, default=1)
    run.add_argument(
        "--continue-stopped",
        action="store_true",
        help="resume runs that train's --time-limit stopped (result.json + checkpoint.pt) instead of skipping them",
    )
    rep = sub.add_parser("report", help="summarize OUT/*/result.json into summary.json, table.md and a plot")
    rep.add_argument("--out", required=True)
    recipe_table.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = _parser().parse_args(ours)
    if args.command == "report":
        if extra:
            raise SystemExit("error: report takes no train arguments")
        report(Path(args.out), argv=argv)
        return 0
    if args.command == "table":
        return recipe_table.run_table(args, extra, argv, __file__)
    return run_grid(args, extra, argv)


if __name__ == "__main__":
    sys.exit(main())
