"""The main job (`equiconvert demo`): convert ResNet9 to D4 and train it with DP-SGD on Fashion-MNIST.

Everything goes through `recipes.runner.run_training` (the engine of `equiconvert train`):
the model is converted, checked for equivariance at the padded input size (28 -> 32),
trained by DPTrainer (Poisson sampling, per-sample clipping, RDP accounting) and
evaluated on the whole test set. The demo adds CPU-friendly defaults (`CPU_DEFAULTS`, one
place), a training time cap, and a summary that it prints and writes to OUT/demo.json.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

SUMMARY_FILE = "demo.json"
STALE_FILES = ("log.jsonl", "checkpoint.pt", "result.json", SUMMARY_FILE)  # a demo run always starts fresh


@dataclass(frozen=True)
class DemoSettings:
    """What the demo trains; `CPU_DEFAULTS` are chosen to finish within 15 minutes on a 2-core CPU.

    time_limit_s caps the training loop (the final evaluation of the test set comes after it);
    None trains for all `steps`. threads None: one per CPU core this process may use.
    """

    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    model: str = "equiconvert:resnet9"
    widths: tuple[int, ...] = (8, 16, 32)
    group: str = "D4"
    epsilon: float = 3.0
    delta: float = 1e-5
    accountant: str = "rdp"
    batch_size: int = 256  # expected (Poisson) batch size
    physical_batch_size: int = 256
    steps: int = 300
    aug_mult: int = 1
    max_grad_norm: float = 2.0
    lr: float = 0.5
    momentum: float = 0.9
    # De et al.'s warm-up caps step t's EMA decay at (1 + t) / (10 + t): 0.971 at the last of 300 steps, so any
    # larger decay trains about the same EMA as 0.97 here (0.999 would need 8,990 steps to apply)
    ema_decay: float = 0.97
    seed: int = 0
    # Filters start at 1/sqrt 2 of He's scale: 80.3 / 80.9% vs 79.1 / 79.9% at He's scale (seeds 0 / 1)
    init_gain: float | None = 2 ** -0.5
    time_limit_s: float | None = 600.0
    device: str | None = None  # None: cuda if available, else cpu
    threads: int | None = None
    out: str = "runs/demo"
    progress: bool = True


# On an idle 2-core CPU: 1.6 s a step, 80.21% after all 300 steps in 481 s (docs/results.md).
CPU_DEFAULTS = DemoSettings()


def cpu_threads() -> int:
    """CPU cores this process may run on (the affinity mask, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _clear_outputs(out: Path) -> None:
    for name in STALE_FILES:
        (out / name).unlink(missing_ok=True)


def run_main_job(settings: DemoSettings = CPU_DEFAULTS) -> dict[str, Any]:
    """Train as `settings` say (through run_training); returns the summary, also written to OUT/demo.json."""
    from .runner import RunSpec, run_training

    start = time.perf_counter()
    s = settings
    threads = s.threads or cpu_threads()
    torch.set_num_threads(threads)
    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    _clear_outputs(out)
    spec = RunSpec(model=s.model, group=s.group, dataset=s.dataset, data_dir=s.data_dir, out=str(out),
                   model_widths=s.widths, device=s.device, progress=s.progress, time_limit_s=s.time_limit_s,
                   init_gain=s.init_gain, overwrite=True)
    result = run_training(
        spec, target_epsilon=s.epsilon, delta=s.delta, accountant=s.accountant, batch_size=s.batch_size,
        physical_batch_size=s.physical_batch_size, steps=s.steps, aug_mult=s.aug_mult, max_grad_norm=s.max_grad_norm,
        lr=s.lr, momentum=s.momentum, ema_decay=s.ema_decay or None, seed=s.seed, checkpoint_every=None,
    )
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
        "settings": {**asdict(s), "widths": list(s.widths)},
        "result_file": str(out / "result.json"),
        "test_loss": result["test_loss"],
        "brier": result["brier"],
        "ece": result["ece"],
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return summary


def settings_from(base: DemoSettings = CPU_DEFAULTS, **overrides: Any) -> DemoSettings:
    """`base` with the non-None overrides applied (command-line flags that were given)."""
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


def format_summary(summary: dict[str, Any]) -> str:
    """The readable report of a demo run."""
    s = summary["settings"]
    widths = ",".join(map(str, s["widths"]))
    lines = [
        f"model: {s['model']} (widths {widths}) -> {s['group']}: "
        f"parameters {summary['params_before']:,} before, {summary['params_after']:,} after conversion",
        f"equivariance check at {summary['equivariance_input_size']}x{summary['equivariance_input_size']} "
        f"(90-degree rotations and flips of the input): max error {summary['max_equivariance_error']:.1e}",
        f"DP-SGD: {summary['steps']} steps of expected batch {s['batch_size']} (Poisson) from "
        f"{summary['train_examples']:,} {s['dataset']} images, aug_mult {s['aug_mult']}, clip {s['max_grad_norm']}, "
        f"noise multiplier {summary['noise_multiplier']:.3f}",
    ]
    if summary["stopped_reason"] == "time_limit":
        lines.append(f"STOPPED EARLY at step {summary['steps']} of {summary['requested_steps']}: the training time "
                     f"limit ({s['time_limit_s']:.0f} s) was reached; the epsilon below is what those steps spent")
    elif summary["stopped_reason"] == "budget":
        lines.append(f"stopped at step {summary['steps']} of {summary['requested_steps']}: one more step would "
                     f"exceed the privacy budget")
    lines += [
        f"privacy: epsilon {summary['epsilon']:.3f} (target {summary['target_epsilon']:g}), delta "
        f"{summary['delta']:g}, {summary['accountant'].upper()} accountant",
        f"test accuracy: {100 * summary['test_accuracy']:.2f}% on {summary['test_examples']:,} test images",
        f"wall time: {summary['wall_time_s']:.0f} s (training {summary['train_time_s']:.0f} s) on "
        f"{summary['device']}" + (f", {summary['threads']} threads" if summary["threads"] else "")
        + (", load average {:.2f} / {:.2f} / {:.2f} (1 / 5 / 15 min) at the end".format(*summary["load_average"])
           if summary["load_average"] else ""),
        f"written: {Path(summary['result_file']).parent / SUMMARY_FILE} (and result.json, log.jsonl there)",
    ]
    return "\n".join(lines)
