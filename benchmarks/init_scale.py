"""Signal scale at initialisation: ResNet9 and its conversions on the same digits, and how their training takes a
learning rate.

For the original and each --groups conversion (widths --widths, head "invariant"), over --seeds draws: the std of
the logits and the initial cross-entropy on --examples upright digits, and the output std of every leaf module
(forward hooks) to show where the scale grows. Then a learning-rate sweep: --steps of non-private SGD (momentum
0.9, batch --batch-size) per --lrs for the --sweep-groups, the final loss and accuracy on the same digits.
--no-unit-invariants converts with config unit_invariants=False (unscaled group pooling). JSON.
Defaults (mnist-10k.npz, 512 digits padded to 32x32, 3 seeds, 100 steps of 32): over 20 minutes on a shared
2-core CPU; fewer --groups, --sweep-groups, --seeds or --steps shorten it.
Usage: python benchmarks/init_scale.py --data-dir /work/shared/data/mnist-10k.npz --out init_scale.json
       python benchmarks/init_scale.py --tiny   (synthetic data, a few seconds: what tests run)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equiconvert import make_equivariant  # noqa: E402
from equiconvert.data import load_dataset  # noqa: E402
from equiconvert.models.resnet9 import resnet9  # noqa: E402

ORIGINAL = "none"  # the unconverted network's row
GROUPS = ("C4", "C8", "C16", "D4", "D8", "D16", "SO2", "O2")
GRID = 8  # the converted ResNet9 is exact at sizes divisible by 8: images are padded up to one


def load_digits(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(normalised images padded to a multiple of GRID, labels, classes): a fixed random subset of the train split."""
    if args.tiny:
        data = load_dataset("synthetic", split="train", num_examples=96, image_size=16, channels=1)
    else:
        data = load_dataset("rotated_mnist", args.data_dir, split="train", max_angle=0.0)
    order = torch.randperm(len(data.labels), generator=torch.Generator().manual_seed(0))
    needed = args.examples + args.steps * args.batch_size
    chosen = order[: min(needed, len(order))]
    images = data.images[chosen].float() / 255
    pad = (-images.shape[-1]) % GRID
    images = F.pad(images, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2))
    images = (images - images.mean()) / images.std()
    return images, data.labels[chosen], len(data.classes)


def build(group: str, args: argparse.Namespace, channels: int, classes: int, size: int) -> nn.Module:
    """The original ResNet9, or its conversion to `group`."""
    model = resnet9(num_classes=classes, in_channels=channels, widths=args.widths)
    if group == ORIGINAL:
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = {"unit_invariants": not args.no_unit_invariants}
        return make_equivariant(model, group, input_size=size, config=config)


def layer_stds(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The logits, and every leaf module's output std (names without the converted model's "network.")."""
    stds: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if name and not any(module.children()):
            key = name.removeprefix("network.")
            hooks.append(module.register_forward_hook(_recorder(stds, key)))
    try:
        with torch.no_grad():
            logits = model.eval()(x)
    finally:
        for hook in hooks:
            hook.remove()
    return logits, stds


def _recorder(stds: dict[str, float], key: str) -> Callable:
    def record(module: nn.Module, inputs: tuple, output: object) -> None:
        if isinstance(output, torch.Tensor):
            stds[key] = float(output.float().std())

    return record


def init_scale(group: str, args, images, labels, classes) -> dict:
    """Mean logit std, initial loss and per-layer output std over the seeds, and each seed's logit std and loss."""
    x, y = images[: args.examples], labels[: args.examples]
    rows = []
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        logits, stds = layer_stds(build(group, args, x.shape[1], classes, x.shape[-1]), x)
        rows.append((float(logits.std()), float(F.cross_entropy(logits, y)), stds))
    layers = {name: _mean([r[2][name] for r in rows if name in r[2]]) for name in rows[0][2]}
    return {
        "logit_std": _mean([r[0] for r in rows]),
        "loss": _mean([r[1] for r in rows]),
        "logit_std_runs": [r[0] for r in rows],
        "loss_runs": [r[1] for r in rows],
        "layer_std": layers,
    }


def lr_sweep(group: str, args, images, labels, classes) -> dict[str, dict]:
    """Per learning rate: the loss and accuracy on the evaluation digits after args.steps of SGD."""
    x_eval, y_eval = images[: args.examples], labels[: args.examples]
    x_train, y_train = images[args.examples :], labels[args.examples :]
    results = {}
    for lr in args.lrs:
        torch.manual_seed(0)
        model = build(group, args, images.shape[1], classes, images.shape[-1]).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        for step in range(args.steps):
            start = (step * args.batch_size) % max(1, len(x_train) - args.batch_size + 1)
            batch = slice(start, start + args.batch_size)
            optimizer.zero_grad()
            F.cross_entropy(model(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
        with torch.no_grad():
            logits = model.eval()(x_eval)
        loss = float(F.cross_entropy(logits, y_eval))
        accuracy = float((logits.argmax(1) == y_eval).float().mean())
        results[str(lr)] = {"loss": loss if math.isfinite(loss) else None, "accuracy": accuracy}
    return results


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _names(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="mnist-10k.npz or an MNIST directory (rotated_mnist)")
    parser.add_argument("--groups", type=_names, default=list(GROUPS))
    parser.add_argument("--widths", type=lambda t: tuple(int(w) for w in t.split(",")), default=(16, 32, 64))
    parser.add_argument("--examples", type=int, default=512, help="digits the scale and the sweep are measured on")
    parser.add_argument("--seeds", type=int, default=3, help="how many initialisations (seeds 0..N-1)")
    parser.add_argument("--lrs", type=_floats, default=[0.01, 0.05, 0.2])
    parser.add_argument("--sweep-groups", type=_names, default=[ORIGINAL, "C8", "O2"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--no-unit-invariants", action="store_true", help="convert with unit_invariants=False")
    parser.add_argument("--tiny", action="store_true", help="synthetic 16x16 data, tiny widths, few steps")
    parser.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.groups, args.sweep_groups, args.widths = ["C4", "SO2"], [ORIGINAL, "C4"], (4, 8, 8)
        args.examples, args.seeds, args.steps, args.batch_size, args.lrs = 32, 2, 2, 16, [0.05]
    if len(args.widths) != 3:
        parser.error(f"--widths takes 3 comma-separated ints, got {args.widths}")
    for flag, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--examples", args.examples)):
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    images, labels, classes = load_digits(args)
    report = {
        "settings": {
            "dataset": "synthetic" if args.tiny else "rotated_mnist (max_angle 0)",
            "image_size": images.shape[-1],
            "widths": list(args.widths),
            "examples": args.examples,
            "seeds": args.seeds,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "unit_invariants": not args.no_unit_invariants,
        },
        "init": {g: init_scale(g, args, images, labels, classes) for g in [ORIGINAL, *args.groups]},
        "lr_sweep": {g: lr_sweep(g, args, images, labels, classes) for g in args.sweep_groups},
    }
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
