"""Recipe tables: train a table's cells (equiconvert/recipes/tables/*.toml) and report them as the results page does.

`python benchmarks/accuracy.py table NAME|FILE` (this module's run_table) trains every cell's first seed before
any cell's second, each run one `equiconvert train --recipe ... --nproc-per-node N`, one after another or side
by side over --gpus. It resumes like the grids (train_runs.plan) and also continues runs that a time limit
stopped. --time-limit is a budget for the whole invocation: each run gets what is left less --startup-margin,
none starts with less than MIN_TRAIN_S of training left, and exit status UNFINISHED_EXIT names the unfinished
cells. The report (paper_table) writes OUT/summary.json in the results page's paper_table schema, OUT/table.md
and OUT/accuracy_vs_epsilon.png.
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import make_results_page
import paper_table
from train_runs import (
    MANAGED_ARGS,
    REPO,
    RUN_FILE,
    Printer,
    check_extra_args,
    execute,
    invocations,
    log_invocation,
    plan,
    print_failures,
    read_json,
    read_parts,
    split_list,
)

TABLE_FILE = "table.json"  # a table's folder: its definition (labels, paper numbers) as last invoked


@dataclass(frozen=True)
class TableRun:
    """One seed of one cell of a recipe table."""

    cell: Any  # equiconvert.recipes.table.Cell
    seed: int

    @property
    def name(self) -> str:
        return paper_table.run_name(self.cell.name, self.seed)

    @property
    def fixed_args(self) -> tuple[str, ...]:
        return (*self.cell.train_args(), "--seed", str(self.seed))


# a table's cells set these through their recipes, or the benchmark sets them per run
TABLE_MANAGED_ARGS = (*MANAGED_ARGS, "--recipe", "--time-limit", "--nproc-per-node")
TABLE_MANAGED_KEYS = (
    "model.name",
    "conversion.group",
    "data.dataset",
    "data.data_dir",
    "dp.epsilon",
    "dp.target_epsilon",
    "schedule.seed",
    "run.out",
    "run.device",
    "run.time_limit_s",
    "run.resume",
    "run.overwrite",
)


STARTUP_MARGIN_S = 120.0  # per run, of a --time-limit budget: start-up, final evaluation and saving
MIN_TRAIN_S = 60.0  # a run starts only with at least this much training time left in the budget
UNFINISHED_EXIT = 3


@dataclass
class Slot:
    """Where one run of a table trains: a label for messages, and the environment that picks its cards."""

    label: str
    env: dict[str, str]


def positive_seconds(text: str) -> float:
    """--time-limit's value: a number of seconds > 0 (0 or less would start nothing yet report the cells unfinished)."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give a number of seconds, not {text!r}") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"give a finite number of seconds > 0 (leave it out for no limit), not {text}")
    return seconds


def table_slots(gpus: list[str], nproc: int, device: str | None) -> list[Slot]:
    """One slot (every visible card) without --gpus; else one slot per --nproc-per-node cards of --gpus."""
    if not gpus:
        return [Slot(device or "train's default device", {})]
    bad = [g for g in gpus if not (g.isascii() and g.isdigit())]
    if bad:
        raise SystemExit(
            f"error: --gpus {','.join(gpus)}: give comma-separated card indices (0, 1, ...), not {bad[0]!r}"
        )
    repeated = sorted({g for g in gpus if gpus.count(g) > 1})
    if repeated:
        raise SystemExit(f"error: --gpus {','.join(gpus)} lists card {repeated[0]} twice: give each card once")
    if len(gpus) % nproc:
        raise SystemExit(f"error: --gpus lists {len(gpus)} cards, not a multiple of --nproc-per-node {nproc}")
    if device not in (None, "cuda"):
        raise SystemExit(f"error: --device {device} with --gpus: each run sees its own cards; give --device cuda")
    groups = [",".join(gpus[i : i + nproc]) for i in range(0, len(gpus), nproc)]
    return [Slot(f"cards {g}", {"CUDA_VISIBLE_DEVICES": g}) for g in groups]


def check_table_extra_args(extra: list[str], cells: list[Any]) -> None:
    """Refuse pass-through arguments that would change what the table's cells define."""
    check_extra_args(extra, TABLE_MANAGED_ARGS)
    cell_keys = {o.split("=", 1)[0].strip() for c in cells for o in c.overrides}
    for i, arg in enumerate(extra):
        value = extra[i + 1] if arg == "--set" and i + 1 < len(extra) else arg.removeprefix("--set=")
        if arg != "--set" and not arg.startswith("--set="):
            continue
        key = value.split("=", 1)[0].strip()
        if key in TABLE_MANAGED_KEYS or key in cell_keys:
            raise SystemExit(
                f"error: --set {value}: {key} is set by the table's cells or by the benchmark for every run; "
                "a table row with another value is a cell of its own (add it to the table file)"
            )


def table_command(
    run: TableRun,
    run_dir: Path,
    data_dir: str | None,
    extra: list[str],
    device: str | None,
    nproc: int,
    time_limit: float | None,
    resume: bool,
) -> list[str]:
    cmd = [sys.executable, "-m", "equiconvert", "train", *run.fixed_args]
    if data_dir is not None:
        cmd += ["--data-dir", data_dir]
    cmd += ["--out", str(run_dir), "--set", "run.progress=false", *extra]
    cmd += ["--device", device] if device is not None else []
    cmd += ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    cmd += ["--time-limit", f"{time_limit:g}"] if time_limit is not None else []
    return cmd + (["--resume"] if resume else ["--overwrite"])


def _load_table(name: str) -> Any:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from equiconvert.recipes.table import TableError, load_table

    try:
        return load_table(name)
    except TableError as exc:
        raise SystemExit(f"error: {exc}") from None


def table_runs(cells: list[Any]) -> list[TableRun]:
    """Every cell's first seed in table order, then every cell's second, ...: the table fills in row by row."""
    rounds = max(len(c.seeds) for c in cells)
    return [TableRun(c, c.seeds[i]) for i in range(rounds) for c in cells if i < len(c.seeds)]


def run_table(args: argparse.Namespace, extra: list[str], argv: list[str], script: str) -> int:
    """Train the table's cells that are not done (within the budget), report, name what is left."""
    table = _load_table(args.table)
    try:
        cells = list(table.select(split_list(args.cells)) if args.cells else table.cells)
    except ValueError as exc:
        raise SystemExit(f"error: --{exc}") from None  # the library names the parameter, cells; the command its flag
    check_table_extra_args(extra, cells)
    if args.nproc_per_node < 1:
        raise SystemExit(f"error: --nproc-per-node {args.nproc_per_node}: give at least 1")
    slots_list = table_slots(split_list(args.gpus or ""), args.nproc_per_node, args.device)
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    out = Path(args.out)
    runs = table_runs(cells)
    done, to_resume, _ = plan(runs, out, extra, continue_stopped=True)
    resuming = {r.name for r in to_resume}
    work = [r for r in runs if r not in done]
    out.mkdir(parents=True, exist_ok=True)
    (out / TABLE_FILE).write_text(json.dumps(paper_table.definition(table), indent=2))
    log_invocation(out, script, argv, table=table.source, cells=[c.name for c in cells], extra_args=extra)
    print(
        f"table {table.source}: {len(runs)} runs of {len(cells)} cells: {len(done)} done (skipped), "
        f"{len(resuming)} to resume, {len(work) - len(resuming)} to start; "
        f"{len(slots_list)} at a time ({', '.join(s.label for s in slots_list)})",
        flush=True,
    )
    slots: queue.Queue[Slot] = queue.Queue()
    for slot in slots_list:
        slots.put(slot)
    say = Printer(len(work))

    def job(run: TableRun) -> dict | None:
        slot = slots.get()
        try:
            limit = None if deadline is None else deadline - time.monotonic() - args.startup_margin
            if limit is not None and limit < MIN_TRAIN_S:
                return {"run": run.name, "skipped": True}
            resume = run.name in resuming
            cmd = table_command(
                run, out / run.name, args.data_dir, extra, args.device, args.nproc_per_node, limit, resume
            )
            record = {
                "run": run.name,
                "cell": run.cell.name,
                "recipe": run.cell.recipe,
                "overrides": list(run.cell.overrides),
                "seed": run.seed,
                "epsilon": run.cell.epsilon,
                "extra_args": [*run.fixed_args, *extra],
                "pass_through": extra,
                "nproc_per_node": args.nproc_per_node,
                "device": args.device,
                "slot": slot.label,
                "time_limit_s": limit,
            }
            return execute(run.name, out / run.name, cmd, record, resume, say, slot.label, slot.env)
        except Exception as exc:  # the benchmark's own error (disk, permissions): still one failed run
            return {"run": run.name, "why": f"{type(exc).__name__}: {exc}", "log": "", "tail": ""}
        finally:
            slots.put(slot)

    with ThreadPoolExecutor(max_workers=len(slots_list)) as pool:
        outcomes = [o for o in pool.map(job, work) if o is not None]
    failures = [o for o in outcomes if not o.get("skipped")]
    table_report(out)
    failed = print_failures(failures, len(work))
    _, resume_left, start_left = plan(runs, out, extra, continue_stopped=True)
    left = {r.name for r in [*resume_left, *start_left]}
    if not left:
        return 1 if failed else 0
    unfinished = []
    for cell in cells:
        seeds = [str(s) for s in cell.seeds if paper_table.run_name(cell.name, s) in left]
        if seeds:
            unfinished.append(f"{cell.name} (seed {', '.join(seeds)})")
    skipped = sum(bool(o.get("skipped")) for o in outcomes)
    why = (
        f"; {skipped} not started: less than {MIN_TRAIN_S:.0f} s of training left in --time-limit "
        f"{args.time_limit:g} after the {args.startup_margin:g} s start-up margin"
        if skipped
        else ""
    )
    print(
        f"unfinished cells: {'; '.join(unfinished)}{why}. Run the same command again to continue them.",
        file=sys.stderr,
    )
    return 1 if failed else UNFINISHED_EXIT


def table_report(out: Path) -> dict:
    """A table folder's summary in the results page's paper_table schema, its Markdown and its figure."""
    definition = json.loads((out / TABLE_FILE).read_text())
    runs = {}
    for cell in definition["cells"]:
        for seed in cell["seeds"]:
            run_dir = out / paper_table.run_name(cell["name"], seed)
            result = read_json(run_dir / "result.json")
            runs[run_dir.name] = {
                "result": result if isinstance(result, dict) and "test_accuracy" in result else None,
                "recorded": read_json(run_dir / RUN_FILE),
                "parts": read_parts(run_dir),
            }
    commands = invocations(out)
    summary = paper_table.summarize(definition, runs, commands[-1]["command"] if commands else None)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    figure = {"figure": {**summary["figure"], "path": "accuracy_vs_epsilon.png"}} if "figure" in summary else {}
    (out / "table.md").write_text("\n".join(make_results_page.render_section({**summary, **figure})))
    paper_table.plot(summary, out / "accuracy_vs_epsilon.png")
    counted = sum(len(r["accuracy"]) for r in summary["rows"])
    print(
        f"report: {counted} finished runs in {len(summary['rows'])} rows -> {out / 'summary.json'}, "
        f"{out / 'table.md'}, {out / 'accuracy_vs_epsilon.png'}",
        flush=True,
    )
    return summary


def add_parser(sub: Any) -> None:
    """The `table` subcommand of benchmarks/accuracy.py."""
    tab = sub.add_parser(
        "table",
        help="train a recipe table's cells (skipping finished runs, resuming stopped ones), then report it "
        "in the results page's paper_table format",
    )
    tab.add_argument("table", help="a shipped table's name (equiconvert/recipes/tables/NAME.toml) or a TOML file")
    tab.add_argument("--out", required=True, help="folder of the table: one sub-folder per run, plus the report")
    tab.add_argument("--data-dir", default=None, help="passed to train as --data-dir (omitted if not given)")
    tab.add_argument("--cells", default=None, help="comma-separated cell names to train (default: every cell)")
    tab.add_argument("--nproc-per-node", type=int, default=1, help="processes (GPUs) per run (default 1)")
    tab.add_argument("--device", default=None, help="train --device (default: train's own, cuda if available)")
    tab.add_argument(
        "--gpus",
        default=None,
        help="comma-separated card indices: runs side by side, each on --nproc-per-node of them "
        "(CUDA_VISIBLE_DEVICES); default: one run at a time on the first --nproc-per-node visible cards",
    )
    tab.add_argument(
        "--time-limit",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="budget of this invocation: each run trains until it is spent (less --startup-margin) and stops "
        "with a checkpoint; the same command continues it",
    )
    tab.add_argument(
        "--startup-margin",
        type=float,
        default=STARTUP_MARGIN_S,
        metavar="SECONDS",
        help=f"of the budget, kept per run for start-up, final evaluation and saving (default {STARTUP_MARGIN_S:g})",
    )
