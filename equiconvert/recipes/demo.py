"""The main job (`equiconvert demo`): convert ResNet9 to D4 and train it with DP-SGD on Fashion-MNIST.

Everything goes through `recipes.runner.run_checked` (the engine of `equiconvert train`):
the model is converted, checked for equivariance at the padded input size (28 -> 32),
trained by DPTrainer (Poisson sampling, per-sample clipping, RDP accounting) and
evaluated on the whole test set. The demo trains the cpu_main_job recipe (`MAIN_JOB_RECIPE`); a timing
probe fits its steps to the time budget before the noise is calibrated (step_plan.py), and it
prints and writes a summary to OUT/demo.json.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .recipe import Recipe, load_recipe

if TYPE_CHECKING:
    from ..training.dp_config import DPConfig
    from .run_spec import RunSpec

SUMMARY_FILE = "demo.json"
STALE_FILES = ("log.jsonl", "checkpoint.pt", "result.json", SUMMARY_FILE)  # a demo run always starts fresh
MAIN_JOB = "cpu_main_job"  # the recipe (equiconvert/recipes/files/cpu_main_job.toml)

MAIN_JOB_RECIPE: Recipe = load_recipe(MAIN_JOB)  # its time and accuracy on a 2-core CPU: docs/results.md


def cpu_threads() -> int:
    """CPU cores this process may run on (the affinity mask, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _clear_outputs(out: Path) -> None:
    for name in STALE_FILES:
        (out / name).unlink(missing_ok=True)


def fresh_run(recipe: Recipe) -> Recipe:
    """A copy of `recipe` that replaces an earlier demo's files in run.out (a demo run always starts fresh)."""
    recipe = copy.deepcopy(recipe)
    recipe.run.overwrite = True
    return recipe


def run_main_job(recipe: Recipe = MAIN_JOB_RECIPE, checked: tuple[RunSpec, DPConfig] | None = None) -> dict[str, Any]:
    """Train as `recipe` says (steps planned to fit its time limit); returns the summary, also written to OUT/demo.json.

    Args:
        recipe: the demo's recipe (MAIN_JOB_RECIPE and any flags).
        checked: recipe_checks.check_recipe(fresh_run(recipe)), when the caller has already checked it; None checks
            it here.
    """
    import torch

    from .recipe_checks import check_recipe
    from .runner import run_checked

    start = time.perf_counter()
    recipe = fresh_run(recipe)
    spec, config = checked if checked is not None else check_recipe(recipe)
    threads = recipe.run.threads or cpu_threads()
    torch.set_num_threads(threads)
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    _clear_outputs(out)
    result = run_checked(spec, config)
    summary = {
        "test_accuracy": result["test_accuracy"],
        "test_examples": result["test_examples"],
        "train_examples": result["train_examples"],
        "epsilon": result["epsilon"],
        "target_epsilon": result["target_epsilon"],
        "delta": result["delta"],
        "accountant": result["accountant"],
        "noise_multiplier": result["noise_multiplier"],
        "params_before": result["params_before"],
        "params_after": result["params"],
        "max_equivariance_error": result["max_equivariance_error"],
        "equivariance_input_size": result["input_size"],
        "steps": result["steps"],
        "requested_steps": result["requested_steps"],
        "stopped_reason": result["stopped_reason"],
        "train_time_s": result["train_time_s"],
        "wall_time_s": time.perf_counter() - start,
        "device": result["device"],
        "threads": threads if result["device"] == "cpu" else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "settings": settings_of(recipe),
        "step_probe": result["step_probe"],
        "result_file": str(out / "result.json"),
        "test_loss": result["test_loss"],
        "brier": result["brier"],
        "ece": result["ece"],
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return summary


def settings_of(recipe: Recipe) -> dict[str, Any]:
    """The recipe as one flat record (what the summary reports)."""
    widths = recipe.model.kwargs.get("widths")
    trainer = {k: v for k, v in asdict(recipe.trainer).items() if not callable(v)}
    return {
        "model": recipe.model.name,
        "model_kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in recipe.model.kwargs.items()},
        "widths": list(widths) if widths else None,
        **asdict(recipe.conversion),
        **asdict(recipe.data),
        **trainer,
        "epsilon": recipe.trainer.target_epsilon,
        **asdict(recipe.run),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The readable report of a demo run."""
    s = summary["settings"]
    widths = f" (widths {','.join(map(str, s['widths']))})" if s["widths"] else ""
    probe = summary["step_probe"]
    lines = [
        f"model: {s['model']}{widths} -> {s['group']}: "
        f"parameters {summary['params_before']:,} before, {summary['params_after']:,} after conversion",
        f"equivariance check at {summary['equivariance_input_size']}x{summary['equivariance_input_size']} "
        f"(90-degree rotations and flips of the input): max error {summary['max_equivariance_error']:.1e}",
        f"DP-SGD: {summary['steps']} steps of expected batch {s['batch_size']} (Poisson) from "
        f"{summary['train_examples']:,} {s['dataset']} images, aug_mult {s['aug_mult']}, clip {s['max_grad_norm']}, "
        f"noise multiplier {summary['noise_multiplier']:.3f}",
    ]
    if probe is not None:
        lines.append(
            f"timing probe: {probe['seconds_per_step']:.2f} s a step over {probe['probe_steps']} steps: "
            f"{probe['planned_steps']} of {probe['requested_steps']} steps fit the "
            f"{probe['time_budget_s']:.0f} s budget"
        )
    if summary["stopped_reason"] == "time_limit":
        lines.append(
            f"STOPPED EARLY at step {summary['steps']} of {summary['requested_steps']}: the training time "
            f"limit ({s['time_limit_s']:.0f} s) was reached; the epsilon below is what those steps spent"
        )
    elif summary["stopped_reason"] == "budget":
        lines.append(
            f"stopped at step {summary['steps']} of {summary['requested_steps']}: one more step would "
            f"exceed the privacy budget"
        )
    lines += [
        f"privacy: epsilon {summary['epsilon']:.3f} (target {summary['target_epsilon']:g}), delta "
        f"{summary['delta']:g}, {summary['accountant'].upper()} accountant",
        f"test accuracy: {100 * summary['test_accuracy']:.2f}% on {summary['test_examples']:,} test images",
        f"wall time: {summary['wall_time_s']:.0f} s (training {summary['train_time_s']:.0f} s) on "
        f"{summary['device']}"
        + (f", {summary['threads']} threads" if summary["threads"] else "")
        + (
            ", load average {:.2f} / {:.2f} / {:.2f} (1 / 5 / 15 min) at the end".format(*summary["load_average"])
            if summary["load_average"]
            else ""
        ),
        f"written: {Path(summary['result_file']).parent / SUMMARY_FILE} (and result.json, log.jsonl there)",
    ]
    return "\n".join(lines)
