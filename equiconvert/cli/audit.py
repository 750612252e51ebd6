"""`equiconvert audit`: an empirical lower bound on epsilon from one DP-SGD run with canaries."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable

from ..training.audit_options import (
    AUDIT_DEFAULTS,
    DEFAULT_BETA,
    GRADIENT_SCORE,
    LINEAR_MODEL,
    SCORE_NAMES,
    SMALL_MODEL_NAMES,
)
from .common import CLIError
from .commands import SUBCOMMANDS


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


# flag -> (what a given value must satisfy, what to give instead); a flag left out keeps its default
FLAG_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "--num-examples": (lambda n: n >= 1, "give at least 1 (or leave it out for all)"),
    "--canaries": (lambda n: n >= 2, "give at least 2 (each is trained on with probability 1/2)"),
    "--confidence": (lambda c: 0.0 < c < 1.0, "give a number in (0, 1), e.g. 0.95"),
    "--epsilon": (_positive, "give a finite privacy budget > 0, e.g. 1"),
    "--delta": (lambda d: 0.0 < d < 1.0, "give a number in (0, 1), e.g. 1e-5"),
    "--noise-multiplier": (_positive, "give a finite sigma > 0 (0 adds no noise: not private)"),
    "--steps": (lambda n: n >= 1, "give at least 1 step to audit"),
    "--batch-size": (lambda n: n >= 1, "give at least 1"),
    "--max-grad-norm": (_positive, "give a finite clipping norm > 0, e.g. 1.0"),
    "--lr": (_positive, "give a finite learning rate > 0"),
}


def check_flags(args: argparse.Namespace) -> None:
    """Refuse the first flag whose value breaks its rule in FLAG_RULES, naming it, before any data is read."""
    for flag, (valid, rule) in FLAG_RULES.items():
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None and not valid(value):
            raise CLIError(f"{flag} {value}: {rule}")


def _cmd_audit(args: argparse.Namespace) -> int:
    """One-run privacy audit (equiconvert.training.audit): print and write OUT/audit.json."""
    import torch

    from ..data import load_dataset
    from ..training.audit import SMALL_MODELS, make_canaries, run_audit

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CLIError(f"--out {out} exists and is not an empty folder; give a new or empty one")
    check_flags(args)
    if args.guesses < 1 or 2 * args.guesses > args.canaries:
        raise CLIError(f"--guesses {args.guesses}: give k >= 1 with 2k at most --canaries ({args.canaries})")
    data = load_dataset(args.dataset, args.data_dir)
    images, labels = data.as_tuple()
    if args.num_examples is not None:
        images, labels = images[: args.num_examples], labels[: args.num_examples]
    torch.manual_seed(args.seed)  # the model's initial weights
    model = SMALL_MODELS[args.model](data.image_shape, data.num_classes)
    canaries = make_canaries(data.image_shape, data.num_classes, args.canaries, seed=args.seed + 1)
    given = {
        "target_epsilon": args.epsilon,
        "delta": args.delta,
        "noise_multiplier": args.noise_multiplier,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "max_grad_norm": args.max_grad_norm,
        "lr": args.lr,
        "seed": args.seed,
    }
    options = {**AUDIT_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    if args.noise_multiplier is not None and args.epsilon is None:  # a fixed sigma: no budget to stop at
        options["target_epsilon"] = None
    result = run_audit(
        model,
        (images, labels),
        canaries,
        guesses_included=args.guesses,
        guesses_excluded=args.guesses,
        score=args.score,
        beta=1.0 - args.confidence,
        inclusion_seed=args.seed,
        device=args.device,
        **options,
    )
    record = json.dumps(result.to_dict() | {"model": args.model, "dataset": args.dataset}, indent=2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(record + "\n")
    print(record)
    return 0


def add_parser(sub) -> None:
    audit = sub.add_parser(
        "audit",
        help=SUBCOMMANDS["audit"],
        description="Train a small model once with DP-SGD on DATASET plus a random half of --canaries random-pixel, "
        "random-label canaries, guess which canaries were trained on, and turn the correct guesses into "
        "a lower bound on epsilon (Steinke, Nasr, Jagielski 2023), printed beside the accountant's "
        "epsilon and written to OUT/audit.json.",
    )
    audit.add_argument("--out", required=True, help="output folder for audit.json (must be new or empty)")
    audit.add_argument("--dataset", default="synthetic", help="any name `equiconvert train` takes (default synthetic)")
    audit.add_argument("--data-dir", default=None)
    audit.add_argument("--num-examples", type=int, default=None, help="use the first N training examples (default all)")
    audit.add_argument("--model", choices=SMALL_MODEL_NAMES, default=LINEAR_MODEL)
    audit.add_argument("--canaries", type=int, default=1000, help="canaries m, each trained on with probability 1/2")
    audit.add_argument(
        "--guesses",
        type=int,
        default=100,
        help="k: the k highest scores are guessed included and the k lowest excluded",
    )
    audit.add_argument(
        "--score",
        choices=SCORE_NAMES,
        default=GRADIENT_SCORE,
        help="gradient: white-box alignment of the weight change with each canary's gradient; "
        "loss: black-box, minus the trained model's loss",
    )
    audit.add_argument("--confidence", type=float, default=1.0 - DEFAULT_BETA)
    audit.add_argument("--epsilon", type=float, default=None, help=f"default {AUDIT_DEFAULTS['target_epsilon']}")
    audit.add_argument("--delta", type=float, default=None, help="default DPConfig's")
    audit.add_argument("--noise-multiplier", type=float, default=None, help="default: calibrated from --epsilon")
    audit.add_argument("--steps", type=int, default=None, help=f"default {AUDIT_DEFAULTS['steps']}")
    audit.add_argument("--batch-size", type=int, default=None, help=f"default {AUDIT_DEFAULTS['batch_size']}")
    audit.add_argument("--max-grad-norm", type=float, default=None, help=f"default {AUDIT_DEFAULTS['max_grad_norm']}")
    audit.add_argument("--lr", type=float, default=None, help=f"default {AUDIT_DEFAULTS['lr']}")
    audit.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the model's initial weights, the canaries, the coins that include them and the trainer's seed",
    )
    audit.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    audit.set_defaults(func=_cmd_audit)
