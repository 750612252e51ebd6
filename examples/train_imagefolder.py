"""Train an equivariant ResNet9 with differential privacy on your own ImageFolder data.

    python examples/train_imagefolder.py --demo-data      # a tiny synthetic data set, ~30 s on a CPU
    python examples/train_imagefolder.py ROOT --epsilon 8 --batch-size 1024 --steps 500 \
        --widths 16,32,64 --aug-mult 4 --device cuda --out runs/mydata

ROOT holds ROOT/train/<class>/*.png|jpg and ROOT/test/<class>/*.png|jpg (``val``/``validation``
also name the test split; a single ROOT/<class>/* is split 80/20 per class). All images must
have one size, or pass --image-size to resize them on loading. They are decoded once into
memory as uint8 (and cached); augmentation and normalisation happen on the training device.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw

import equiconvert
from equiconvert.data import load_dataset
from equiconvert.models import resnet9
from equiconvert.training import DPConfig, DPTrainer
from equiconvert.recipes.build_model import padded_size

DEFAULTS = DPConfig()
# flag -> DPTrainer option, passed only when given (otherwise DPConfig's default)
OPTIONAL = {
    "epsilon": "target_epsilon",
    "delta": "delta",
    "lr": "lr",
    "max_grad_norm": "max_grad_norm",
    "ema_decay": "ema_decay",
    "physical_batch_size": "physical_batch_size",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", help="the ImageFolder root (not needed with --demo-data)")
    parser.add_argument("--demo-data", action="store_true", help="write a tiny synthetic ImageFolder and train on it")
    parser.add_argument("--image-size", type=int, default=None, help="resize every image to this square size")
    parser.add_argument("--group", default="D4", help="C1..C16, D1..D16, or SO2/O2")
    parser.add_argument(
        "--widths",
        default="8,16,32",
        help="ResNet9 channel widths (Hölzl et al.: 16,32,64; Klause et al.'s ResNet9: 64,128,256)",
    )
    # None: not given, DPConfig's default applies (DPTrainer receives only the options given)
    parser.add_argument(
        "--epsilon",
        type=float,
        default=None,
        help=f"target epsilon, the noise is calibrated to it (default {DEFAULTS.target_epsilon:g})",
    )
    parser.add_argument(
        "--delta",
        type=float,
        default=None,
        help="default: from the number N of training examples, at most 1/(10 N) (privacy.accounting.default_delta)",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="expected logical batch (Poisson sampling)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--aug-mult", type=int, default=2, help="augmented views per example (averaged before clipping)"
    )
    parser.add_argument("--lr", type=float, default=None, help=f"default {DEFAULTS.lr:g}")
    parser.add_argument("--max-grad-norm", type=float, default=None, help=f"default {DEFAULTS.max_grad_norm:g}")
    parser.add_argument("--ema-decay", type=float, default=None, help=f"default {DEFAULTS.ema_decay:g}")
    parser.add_argument(
        "--physical-batch-size",
        type=int,
        default=None,
        help=f"examples per chunk in memory (default {DEFAULTS.physical_batch_size})",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--out", default=None, help="write the JSON-lines log (and checkpoints) here")
    args = parser.parse_args()
    if (args.root is None) == (not args.demo_data):
        parser.error("give an ImageFolder ROOT or --demo-data (not both)")
    return args


def write_demo_data(root: Path, per_class: int = 20, size: int = 32, seed: int = 0) -> None:
    """A two-class ImageFolder of PNGs: filled disks vs filled squares, random place, size and colour.

    Both shapes look the same after 90-degree rotations and flips, so a D4-invariant model can
    tell them apart (horizontal vs vertical stripes, say, it could not). 4 of each class go to test/.
    """
    rng = np.random.default_rng(seed)
    for label in ("disk", "square"):
        for i in range(per_class):
            split = "test" if i < 4 else "train"
            folder = root / split / label
            folder.mkdir(parents=True, exist_ok=True)
            image = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(0, 80, 3)))
            radius = int(rng.integers(5, 10))
            cx, cy = (int(v) for v in rng.integers(radius + 1, size - radius - 1, 2))
            box = (cx - radius, cy - radius, cx + radius, cy + radius)
            colour = tuple(int(v) for v in rng.integers(150, 256, 3))
            (ImageDraw.Draw(image).ellipse if label == "disk" else ImageDraw.Draw(image).rectangle)(box, fill=colour)
            image.save(folder / f"{i:03d}.png")


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="equiconvert-demo-") as tmp:
        root = args.root
        if args.demo_data:
            root = Path(tmp) / "shapes"
            write_demo_data(root)
            print(f"wrote a demo ImageFolder to {root}")
        # Whole splits as uint8 (N, C, H, W) tensors; the temporary demo data is not cached.
        options = dict(image_size=args.image_size, cache=not args.demo_data)
        train = load_dataset("imagefolder", root, split="train", **options)
        test = load_dataset("imagefolder", root, split="test", **options)
    channels, height, width = train.images.shape[1:]
    if height != width:
        raise SystemExit(f"images are {height}x{width}; pass --image-size to make them square")
    print(f"{len(train)} training and {len(test)} test images of {channels}x{height}x{width}, classes {train.classes}")

    # An ordinary ResNet9, converted. head="invariant" pools globally: the logits are invariant.
    widths = tuple(int(w) for w in args.widths.split(","))
    model = resnet9(num_classes=len(train.classes), in_channels=channels, widths=widths)
    model = equiconvert.make_equivariant(model, group=args.group, head="invariant")
    print(f"parameters: {model.report.params_before:,} -> {model.report.params_after:,}")

    # Exact equivariance needs a valid input size (ResNet9: 0 mod 8): pad symmetrically up to one.
    size = padded_size(model, height)
    margin = (size - height) // 2
    train_images, test_images = (F.pad(images, (margin,) * 4) for images in (train.images, test.images))
    error = equiconvert.check_equivariance(model, input_size=size, batch_size=1).max_error
    padding = f"padded from {height}" if size != height else "no padding needed"
    print(f"input size {size} ({padding}): max equivariance error {error:.2e}")

    # DP-SGD: Poisson sampling, per-example clipping of the gradient averaged over aug_mult views,
    # Gaussian noise calibrated to (epsilon, delta) for these steps, EMA of the weights.
    given = {option: getattr(args, flag) for flag, option in OPTIONAL.items() if getattr(args, flag) is not None}
    trainer = DPTrainer(
        model,
        batch_size=args.batch_size,
        steps=args.steps,
        aug_mult=args.aug_mult,
        device=args.device,
        out_dir=args.out,
        **given,
    )
    trainer.fit((train_images, train.labels), eval_set=(test_images, test.labels))
    final = trainer.history[-1]["final_eval"]
    print(
        f"noise multiplier {trainer.noise_multiplier:.3f}, {trainer.step} steps, "
        f"epsilon {trainer.epsilon:.3f} (delta {trainer.delta:g})"
    )
    print(f"test accuracy: {final['accuracy']:.4f} (loss {final['loss']:.4f})")


if __name__ == "__main__":
    main()
