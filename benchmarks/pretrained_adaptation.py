"""Private fine-tuning of a pretrained CNN, plain or canonicalised, against a converted model from scratch.

A small GroupNorm CNN is pretrained without privacy on Fashion-MNIST (public data here), then each of three
models is fine-tuned with DP-SGD (DPTrainer, --epsilon) on upright MNIST digits (mnist-10k.npz, its fixed
8,000 / 2,000 split):
  scratch_converted:        the same CNN, freshly initialised, converted by make_equivariant (invariant head);
  pretrained:               the pretrained CNN as it is;
  pretrained_canonicalized: the pretrained CNN behind equiconvert.canonicalize, trained with pose_prior_loss.
Each is tested on the upright test digits and on the same digits turned by a random multiple of 90 degrees
(and flipped, for a D group). JSON summary.
Usage: python benchmarks/pretrained_adaptation.py --out results/pretrained_adaptation.json
       python benchmarks/pretrained_adaptation.py --tiny          # a smoke run of a few steps
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equiconvert import canonicalize, make_equivariant, pose_prior_loss  # noqa: E402
from equiconvert.data import load_dataset  # noqa: E402
from equiconvert.groups import parse_group  # noqa: E402
from equiconvert.privacy.accounting import calibrate_noise_multiplier, default_delta  # noqa: E402
from equiconvert.training.trainer import DPTrainer  # noqa: E402

SIZE, CLASSES, MEAN, STD = 28, 10, 0.5, 0.5  # DPTrainer's default normalisation, used for pretraining too
FULL = dict(pretrain_steps=600, pretrain_examples=None, train_examples=None, test_examples=None, steps=150)
TINY = dict(pretrain_steps=3, pretrain_examples=256, train_examples=64, test_examples=64, steps=2)
ACCOUNTANT = "rdp"


class SmallCNN(nn.Module):
    """Three 3x3 convolutions with GroupNorm (DP-safe), global average pooling and a linear classifier."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for index, (c_in, c_out) in enumerate(((1, width), (width, 2 * width), (2 * width, 2 * width))):
            stride = 1 if index == 0 else 2
            layers += [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.GroupNorm(4, c_out), nn.ReLU()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(2 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def _normalised(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255 - MEAN) / STD


def pretrain(images: torch.Tensor, labels: torch.Tensor, steps: int, batch_size: int, seed: int) -> nn.Module:
    """SmallCNN trained without privacy (Adam, random batches) on public data."""
    torch.manual_seed(seed)
    model = SmallCNN().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(0, len(labels), (batch_size,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(_normalised(images[batch])), labels[batch]).backward()
        optimizer.step()
    return model.eval()


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model.eval()(_normalised(images)).argmax(-1) == labels).float().mean())


def subset(images: torch.Tensor, labels: torch.Tensor, count: int | None, seed: int) -> tuple[torch.Tensor, ...]:
    """`count` examples drawn without replacement (the splits are sorted by label); None: all of them."""
    if count is None:
        return images, labels
    picks = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))[:count]
    return images[picks], labels[picks]


def turned(images: torch.Tensor, group: str, seed: int) -> torch.Tensor:
    """Each image acted on by a random element of `group` (quarter turns, and flips for a D group)."""
    elements = parse_group(group).grid_elements
    picks = torch.randint(0, len(elements), (len(images),), generator=torch.Generator().manual_seed(seed))
    return torch.stack([elements[int(k)].act_on_grid(image) for image, k in zip(images, picks)])


def noise_multiplier(args: argparse.Namespace, examples: int) -> float:
    """The noise that spends --epsilon in --steps Poisson steps of --batch-size (the same for every model)."""
    delta = default_delta(examples)
    return calibrate_noise_multiplier(args.epsilon, delta, args.batch_size / examples, args.steps, ACCOUNTANT)


def fine_tune(model: nn.Module, loss_fn, train, sigma: float, args: argparse.Namespace) -> DPTrainer:
    trainer = DPTrainer(
        model,
        loss_fn=loss_fn,
        noise_multiplier=sigma,
        target_epsilon=None,
        accountant=ACCOUNTANT,
        batch_size=args.batch_size,
        steps=args.steps,
        aug_mult=1,
        augment_flip=False,
        lr=args.lr,
        max_grad_norm=1.0,
        ema_decay=None,
        epsilon_every=max(args.steps, 1),
        progress=False,
        seed=args.seed,
    )
    trainer.fit(train)
    return trainer


def candidates(pretrained: nn.Module, group: str, prior_weight: float) -> dict[str, tuple[nn.Module, object]]:
    """The three models to fine-tune, each with its loss_fn (None: cross-entropy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report's notes on the padded input size
        scratch = make_equivariant(SmallCNN(), group, head="invariant", input_size=SIZE, pad_to_valid=True)
    wrapped = canonicalize(copy.deepcopy(pretrained), group, in_channels=1, fields=2, kernel_size=5, pool=2)
    return {
        "scratch_converted": (scratch, None),
        "pretrained": (copy.deepcopy(pretrained), None),
        "pretrained_canonicalized": (wrapped, pose_prior_loss(wrapped, weight=prior_weight)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fashion-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--mnist", default="/work/shared/data/mnist-10k.npz", help="mnist-10k.npz (or a folder)")
    parser.add_argument("--group", default="C4", help="C4 or D4")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--prior-weight", type=float, default=0.5, help="pose_prior_loss's weight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="DP-SGD steps (default: 150; --tiny: 2)")
    parser.add_argument("--pretrain-steps", type=int, default=None, help="default: 600; --tiny: 3")
    parser.add_argument("--tiny", action="store_true", help="a few steps on a few examples (a smoke test)")
    parser.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = parser.parse_args(argv)
    sizes = dict(TINY if args.tiny else FULL)
    args.steps = sizes["steps"] if args.steps is None else args.steps
    if args.pretrain_steps is not None:
        sizes["pretrain_steps"] = args.pretrain_steps
    if args.tiny:
        args.batch_size = min(args.batch_size, 16)

    fashion = load_dataset("fashion_mnist", args.fashion_dir, split="train")
    fashion_test = load_dataset("fashion_mnist", args.fashion_dir, split="test")
    digits = load_dataset("rotated_mnist", args.mnist, split="train", max_angle=0.0)
    digits_test = load_dataset("rotated_mnist", args.mnist, split="test", max_angle=0.0)
    pretrain_set = subset(fashion.images, fashion.labels, sizes["pretrain_examples"], args.seed)
    pretrained = pretrain(*pretrain_set, sizes["pretrain_steps"], 128, args.seed)
    train = subset(digits.images, digits.labels, sizes["train_examples"], args.seed)
    upright, labels = subset(digits_test.images, digits_test.labels, sizes["test_examples"], args.seed)
    rotated = turned(upright, args.group, args.seed + 1)

    sigma = noise_multiplier(args, len(train[1]))
    results = {}
    for name, (model, loss_fn) in candidates(pretrained, args.group, args.prior_weight).items():
        trainer = fine_tune(model, loss_fn, train, sigma, args)
        results[name] = {
            "upright_accuracy": accuracy(trainer.model, upright, labels),
            "turned_accuracy": accuracy(trainer.model, rotated, labels),
            "epsilon": trainer.epsilon,
            "steps": trainer.step,
            "per_sample_method": trainer.per_sample_method,
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
        }
    summary = {
        "group": args.group,
        "target_epsilon": args.epsilon,
        "noise_multiplier": sigma,
        "tiny": args.tiny,
        "pretrain": {
            "steps": sizes["pretrain_steps"],
            "fashion_mnist_test_accuracy": accuracy(
                pretrained, *subset(fashion_test.images, fashion_test.labels, sizes["test_examples"], args.seed)
            ),
        },
        "fine_tune": {
            "train_examples": len(train[1]),
            "test_examples": len(labels),
            "batch_size": args.batch_size,
            "lr": args.lr,
            "prior_weight": args.prior_weight,
        },
        "results": results,
    }
    text = json.dumps(summary, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
