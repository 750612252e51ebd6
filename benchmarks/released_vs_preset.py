"""The paper's released code against our released-settings preset: same data, seeds, schedule and noise.

Two arms per seed, each a process of its own, run side by side (`--jobs` at once, on one device):
  released  the checkout of hlzl/equivariant (at 3dd7cd0, --released DIR) trained by released_training.py: its own
            model and augmentation, stepped as its train.py steps them (clip C on each example's sum of view
            gradients, noise sigma C, divided by bs, SGD at lr, EMA per physical batch);
  preset    `equiconvert train --recipe cifar10_paper_d4_eps8_released` with the same schedule, translated as that
            recipe translates it: the mean of the views clipped at C / K, lr x K x (expected batch / bs), the EMA
            decay per step the released code's per physical batch compounds to.
The released code's own settings (bs is replaced by --batch-size, its steps by --steps) are read from its hydra
files. Both arms share one noise multiplier: the one that spends --epsilon at the released sampling rate
1 / (N // bs) over --steps steps (RDP). Each run is a folder under --runs; a finished run is kept, a stopped one
(--time-limit, or killed) resumes from its checkpoint when the same command runs again.

    python benchmarks/released_vs_preset.py --released DIR --data-dir .data/cifar10 --device cuda \\
        --seeds 0,1,2 --steps 200 --batch-size 1000 --runs benchmarks/results/released_vs_preset --out OUTDIR

Writes OUTDIR/released_vs_preset.json (default: $OUT, else --runs): a results-page summary (kind
released_vs_preset) with each run's accuracy, epsilon, steps and wall time, each arm's mean and standard error, and
their difference with its standard error.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # the package and the sibling modules, also when loaded by path
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

import train_runs  # noqa: E402
from json_output import emit  # noqa: E402
from equiconvert.data import load_dataset  # noqa: E402
from equiconvert.cli.common import exit_code, flag_message  # noqa: E402
from equiconvert.errors import EquiconvertError, UsageError  # noqa: E402
from equiconvert.privacy.accounting import calibrate_noise_multiplier  # noqa: E402
from equiconvert.recipes.recipe import load_recipe, recipe_value  # noqa: E402
from released_code import ENV_VAR, RELEASED_COMMIT, RELEASED_REPO, released_commit, released_config, released_dir  # noqa: E402
from released_training import ReleasedSettings, train_released  # noqa: E402

RECIPE = "cifar10_paper_d4_eps8_released"
ARMS = ("released", "preset")
SETTINGS_FILE = "settings.json"
SUMMARY_FILE = "released_vs_preset.json"
DEFAULT_RUNS = REPO / "benchmarks" / "results" / "released_vs_preset"


@dataclass(frozen=True)
class PlannedArm:
    """One (arm, seed) run: its folder name and the arguments that define it (train_runs.PlannedRun)."""

    arm: str
    seed: int
    fixed_args: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.arm}_seed{self.seed}"


def released_settings(root: Path, args: argparse.Namespace, examples: int) -> ReleasedSettings:
    """The released recipe (its hydra files) at this schedule, with the noise multiplier both arms use."""
    config = released_config(root)
    aug_mult = int(config["params"]["aug_mult"])
    rate = 1.0 / (examples // args.batch_size)
    recipe = load_recipe(RECIPE)
    return ReleasedSettings(
        steps=args.steps,
        batch_size=args.batch_size,
        aug_mult=aug_mult,
        max_grad_norm=float(config["dp"]["clip_norm"]),
        lr=float(config["optim"]["optimizer"]["lr"]),
        ema_decay=float(config["params"]["decay"]),
        physical_batch_size=args.physical_batch_size or int(config["hardware"]["bs_physical"]) // aug_mult,
        noise_multiplier=calibrate_noise_multiplier(args.epsilon, args.delta, rate, args.steps, "rdp"),
        delta=args.delta,
        normalize_mean=tuple(recipe_value(recipe, "data.normalize_mean")),
        normalize_std=tuple(recipe_value(recipe, "data.normalize_std")),
        checkpoint_every=args.checkpoint_every,
    )


def preset_args(s: ReleasedSettings, examples: int, args: argparse.Namespace) -> tuple[str, ...]:
    """`equiconvert train` arguments of the preset arm: the released recipe's translation at this schedule."""
    expected = round(examples * s.sample_rate(examples))
    per_step = math.ceil(expected / s.physical_batch_size)  # the released EMA's updates in one step
    sets = {
        "dp.noise_multiplier": repr(s.noise_multiplier),
        "schedule.ema_decay": repr(s.ema_decay**per_step),
        "schedule.eval_every": str(s.steps),
        "schedule.checkpoint_every": str(s.checkpoint_every),
        **dict(item.split("=", 1) for item in args.preset_set),
    }
    return (
        "--recipe", RECIPE,
        "--data-dir", str(args.data_dir),
        "--steps", str(s.steps),
        "--batch-size", str(expected),
        "--aug-mult", str(s.aug_mult),
        "--epsilon", repr(args.epsilon),
        "--delta", repr(s.delta),
        "--max-grad-norm", repr(s.max_grad_norm / s.aug_mult),
        "--lr", repr(s.lr * s.aug_mult * expected / s.batch_size),
        *(arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")),
    )  # fmt: skip


def planned(args: argparse.Namespace, s: ReleasedSettings, examples: int) -> list[PlannedArm]:
    released = (
        "--released", str(args.released),
        "--data-dir", str(args.data_dir),
        "--steps", str(s.steps),
        "--batch-size", str(s.batch_size),
        "--epsilon", repr(args.epsilon),
        "--delta", repr(s.delta),
        "--physical-batch-size", str(s.physical_batch_size),
        "--checkpoint-every", str(s.checkpoint_every),
    )  # fmt: skip
    fixed = {"released": released, "preset": preset_args(s, examples, args)}
    return [PlannedArm(arm, seed, fixed[arm]) for seed in args.seeds for arm in args.arms]


def command(run: PlannedArm, args: argparse.Namespace, run_dir: Path, resume: bool) -> list[str]:
    """The process of one run: `equiconvert train` for the preset, this script's --worker for the released code."""
    limit = ("--time-limit", str(args.time_limit)) if args.time_limit else ()
    if run.arm == "preset":
        where = ("--seed", str(run.seed), "--out", str(run_dir), "--device", args.device, *limit)
        return [
            sys.executable,
            "-m",
            "equiconvert",
            "train",
            *run.fixed_args,
            *where,
            *(("--resume",) if resume else ()),
        ]
    worker = ("--worker", "--seed", str(run.seed), "--runs", str(args.runs), "--device", args.device, *limit,
              "--loader-workers", str(args.loader_workers))  # fmt: skip
    return [sys.executable, str(Path(__file__).resolve()), *run.fixed_args, *worker]


def run_arms(args: argparse.Namespace, runs: list[PlannedArm]) -> list[dict]:
    """Start or resume every unfinished run, --jobs at once; the failures, each with its log's tail."""
    done, resume, start = train_runs.plan(runs, args.runs, [], continue_stopped=True)
    say = train_runs.Printer(len(resume) + len(start))
    say(f"{len(done)} runs done, {len(resume)} to resume, {len(start)} to start")

    def one(run: PlannedArm, again: bool) -> dict | None:
        run_dir = args.runs / run.name
        record = {"arm": run.arm, "seed": run.seed, "extra_args": list(run.fixed_args)}
        return train_runs.execute(
            run.name, run_dir, command(run, args, run_dir, again), record, again, say, args.device
        )

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outcomes = list(pool.map(lambda item: one(*item), [(r, True) for r in resume] + [(r, False) for r in start]))
    return [failure for failure in outcomes if failure]


def run_rows(args: argparse.Namespace, runs: list[PlannedArm]) -> list[dict]:
    """One row per run with a result: accuracy (percent), epsilon, steps, wall time over all its parts."""
    rows = []
    for run in runs:
        result = train_runs.read_json(args.runs / run.name / "result.json")
        if not result:
            continue
        parts = train_runs.read_parts(args.runs / run.name)
        accuracy = result.get("test_accuracy")
        rows.append(
            {
                "arm": run.arm,
                "seed": run.seed,
                "test_accuracy": None if accuracy is None else 100.0 * accuracy,
                "epsilon": result.get("epsilon"),
                "steps": result.get("steps"),
                "requested_steps": result.get("requested_steps"),
                "stopped_reason": result.get("stopped_reason"),
                "wall_time_s": sum(p.get("wall_time_s") or 0.0 for p in parts) or result.get("wall_time_s"),
            }
        )
    return rows


def mean_and_se(values: list[float]) -> dict:
    """Mean, sample std and standard error of the mean (None where fewer than two values)."""
    std = statistics.stdev(values) if len(values) > 1 else None
    return {
        "n": len(values),
        "mean": statistics.fmean(values) if values else None,
        "std": std,
        "se": None if std is None else std / math.sqrt(len(values)),
    }


def compare(rows: list[dict]) -> dict:
    """Each arm's mean over its finished runs, and released minus preset with the SE of a difference of means."""
    finished = [r for r in rows if r["stopped_reason"] is None and r["test_accuracy"] is not None]
    arms = {arm: mean_and_se([r["test_accuracy"] for r in finished if r["arm"] == arm]) for arm in ARMS}
    released, preset = arms["released"], arms["preset"]
    difference = None
    if released["se"] is not None and preset["se"] is not None:
        se = math.hypot(released["se"], preset["se"])
        gap = released["mean"] - preset["mean"]
        difference = {"points": gap, "se": se, "in_se": gap / se if se else None}
    return {"arms": arms, "released_minus_preset": difference}


def summary(
    args: argparse.Namespace, s: ReleasedSettings, examples: int, runs: list[PlannedArm], argv: list[str]
) -> dict:
    """The results-page summary: settings, the short schedule against the full one, the runs, the comparison, and
    the runs without a result (failed: their logs are in their folders)."""
    rows = run_rows(args, runs)
    reported = {(r["arm"], r["seed"]) for r in rows}
    recipe = load_recipe(RECIPE)
    full_batch, full_sigma = recipe_value(recipe, "dp.batch_size"), recipe_value(recipe, "dp.noise_multiplier")
    expected = examples * s.sample_rate(examples)
    device = torch.device(args.device)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return {
        "kind": "released_vs_preset",
        "order": 3,  # beside the paper table and the fidelity check
        "title": "The released code against our released-settings preset, same data and schedule",
        "description": (
            f"The paper's released code ({RELEASED_REPO} at {RELEASED_COMMIT}: its own model, augmentation and step, "
            f"benchmarks/released_training.py) and our recipe {RECIPE} with the same schedule, on the same data "
            f"({examples:,} training images), seeds and noise multiplier: {s.steps} steps of expected batch "
            f"{expected:g} x {s.aug_mult} views at sampling rate {s.sample_rate(examples):.6g}, sigma "
            f"{s.noise_multiplier:.4f} for epsilon {args.epsilon:g} (RDP, delta {s.delta:g}). The noise per step "
            f"relative to the batch (expected batch / sigma): {expected / s.noise_multiplier:.0f} here, "
            f"{full_batch / full_sigma:.0f} in the recipe's {recipe_value(recipe, 'schedule.steps')} steps; "
            f"the short schedule takes {s.steps * expected / examples:.1f} epochs where the full one takes "
            f"{recipe_value(recipe, 'schedule.steps') * full_batch / examples:.0f}. The released arm clips each "
            f"example's sum of view gradients at {s.max_grad_norm:g}, divides by {s.batch_size} and steps at lr "
            f"{s.lr:g}, its EMA ({s.ema_decay:g}) updated after each physical batch of up to "
            f"{s.physical_batch_size}; the preset clips the views' mean at {s.max_grad_norm / s.aug_mult:g} with the "
            "learning rate and per-step EMA that recipe translates them to."
        ),
        "command": train_runs.shown_command(__file__, argv),
        "card": card,
        "date": datetime.now(timezone.utc).date().isoformat(),
        "released_commit": released_commit(args.released),
        "settings": asdict(s),
        "rows": rows,
        "runs_without_result": [run.name for run in runs if (run.arm, run.seed) not in reported],
        **compare(rows),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--released",
        type=Path,
        default=None,
        help=f"a checkout of {RELEASED_REPO} at {RELEASED_COMMIT} (default ${ENV_VAR})",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        required=True,
        help="CIFAR-10: an ImageFolder copy (train/, test/) or the pickle batches",
    )
    p.add_argument("--seeds", type=lambda t: [int(x) for x in train_runs.split_list(t)], default=[0, 1, 2])
    p.add_argument("--arms", type=lambda t: train_runs.split_list(t), default=list(ARMS), help="released,preset")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--batch-size", type=int, default=1000, help="the released code's bs (its sampling rate is 1 / (N // bs))"
    )
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument(
        "--physical-batch-size",
        type=int,
        default=None,
        help="the released arm's physical batch (default: its hardware.bs_physical / aug_mult)",
    )
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument(
        "--preset-set", action="append", default=[], metavar="KEY=VALUE", help="more --set for the preset arm"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--jobs", type=int, default=6, help="runs at once")
    p.add_argument("--loader-workers", type=int, default=4, help="processes making the released arm's views (0: none)")
    p.add_argument(
        "--time-limit",
        type=int,
        default=None,
        help="seconds each run trains in this call before it checkpoints and stops",
    )
    p.add_argument("--runs", type=Path, default=DEFAULT_RUNS, help="the run folders")
    p.add_argument("--out", type=Path, default=None, help="folder of the summary (default: $OUT, else --runs)")
    p.add_argument(
        "--worker", action="store_true", help=argparse.SUPPRESS
    )  # one released run (the process `command` starts)
    p.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)
    return p


def check(args: argparse.Namespace) -> None:
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown:
        raise UsageError(f"--arms: unknown arm(s) {unknown}; choose from {list(ARMS)}")
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--jobs", args.jobs)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    bad = [item for item in args.preset_set if "=" not in item]
    if bad:
        raise UsageError(f"--preset-set takes KEY=VALUE, got {bad[0]!r}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    check(args)
    args.released = released_dir(args.released)
    train = load_dataset("cifar10", args.data_dir, "train")
    if args.batch_size > len(train.labels):
        raise UsageError(
            f"--batch-size {args.batch_size} exceeds the {len(train.labels)} training images of {args.data_dir}"
        )
    s = released_settings(args.released, args, len(train.labels))
    if args.worker:
        run_dir = args.runs / PlannedArm("released", args.seed, ()).name
        test = load_dataset("cifar10", args.data_dir, "test")
        device = torch.device(args.device)
        train_released(args.released, train, test, args.seed, s, run_dir, device, args.time_limit, args.loader_workers)
        return 0
    args.runs.mkdir(parents=True, exist_ok=True)
    runs = planned(args, s, len(train.labels))
    failures = run_arms(args, runs)
    out = args.out or Path(os.environ.get("OUT") or args.runs)
    print(emit(summary(args, s, len(train.labels), runs, argv), out / SUMMARY_FILE))
    return 1 if train_runs.print_failures(failures, len(runs)) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except EquiconvertError as error:  # one line naming the flag, and the exit status of the error's category
        print(f"error: {flag_message(error)}", file=sys.stderr)
        sys.exit(exit_code(error))
