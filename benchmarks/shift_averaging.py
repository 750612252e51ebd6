"""Test-time shift averaging of a trained run: its test metrics plain and averaged over each named shift set.

For a DPTrainer checkpoint.pt of the paper's Equivariant-ResNet9 converted to --group (its EMA weights when it has
them, as the trainer evaluates), on the test split of --dataset: the plain metrics and, for each set of
equiconvert.training.augment.TEST_SHIFTS, the metrics of the softmax averaged over the shifted copies of each image
(what `equiconvert train --test-shifts SET` reports). JSON.
Usage: python benchmarks/shift_averaging.py --data-dir /usr/share/datasets/fashion-mnist --group D1 \
           --checkpoint runs/fm_d1/checkpoint.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

for _path in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parent):  # the package, the siblings
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from json_output import emit  # noqa: E402

from equiconvert.data import load_dataset  # noqa: E402
from equiconvert.models.equivariant_resnet9 import equivariant_resnet9  # noqa: E402
from equiconvert.training.augment import TEST_SHIFTS, shift_set  # noqa: E402
from equiconvert.training.ema import ExponentialMovingAverage  # noqa: E402
from equiconvert.training.metrics import evaluate  # noqa: E402
from equiconvert.recipes.build_model import pad_images, padded_size  # noqa: E402


def evaluated_weights(state: dict, group: str, classes: int, channels: int) -> nn.Module:
    """The paper's model for `group` with a checkpoint's EMA weights (its raw weights when it kept no EMA)."""
    model = equivariant_resnet9(group, classes, channels)
    model.load_state_dict(state["model"])
    if state.get("ema"):
        ema = ExponentialMovingAverage(model)
        ema.load_state_dict(state["ema"])
        ema.copy_to(model)
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a DPTrainer checkpoint.pt of the paper's model")
    parser.add_argument("--group", default="D1")
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--sets", default=",".join(TEST_SHIFTS), help="comma-separated names of TEST_SHIFTS")
    parser.add_argument("--examples", type=int, default=None, help="the first N test images (default: all)")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = parser.parse_args(argv)

    sets = {name: shift_set(name) for name in args.sets.split(",")}
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    test = load_dataset(args.dataset, args.data_dir, split="test")
    images, labels = test.images[: args.examples], test.labels[: args.examples]
    model = evaluated_weights(state, args.group, len(test.classes), images.shape[1])
    images = pad_images(images, padded_size(model, images.shape[-1]))
    mean, std = state["config"]["normalize_mean"], state["config"]["normalize_std"]

    def measure(shifts: tuple[tuple[int, int], ...] | None) -> dict[str, float]:
        return evaluate(model, images, labels, args.batch_size, "cpu", lambda x: (x - mean) / std, shifts)

    result = {
        "checkpoint": args.checkpoint,
        "group": args.group,
        "dataset": args.dataset,
        "step": state["step"],
        "examples": len(labels),
        "plain": measure(None),
        "shift_averaged": {name: measure(shifts) for name, shifts in sets.items()},
    }
    print(emit(result, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
