"""An ordinary Opacus training script, made rotation/reflection-equivariant by one line.

    python examples/opacus_one_line.py                        # random 1x32x32 data, 3 steps, ~20 s on a CPU
    python examples/opacus_one_line.py --fashion-mnist /usr/share/datasets/fashion-mnist \
        --num-examples 0 --batch-size 256 --epochs 3 --steps 0 --widths 16,32,64

Everything below is the usual Opacus recipe (a DataLoader, SGD, PrivacyEngine.make_private,
a training loop, get_epsilon). Compared with the non-equivariant version of this script, the
changes are the line marked "THE ONE LINE" and the two equiconvert imports. The second import
registers equiconvert's Opacus grad samplers for the steerable layers; without it Opacus still
trains the converted model, through its generic functorch per-sample gradients.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

import equiconvert
import equiconvert.privacy.opacus_interop  # noqa: F401  (Opacus grad samplers for the steerable layers)
from equiconvert.models import resnet9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fashion-mnist",
        metavar="DIR",
        default=None,
        help="train on Fashion-MNIST's IDX files in DIR (default: random 1x32x32 tensors)",
    )
    parser.add_argument("--num-examples", type=int, default=64, help="training examples (0: the whole split)")
    parser.add_argument(
        "--widths",
        default="8,16,32",
        help="ResNet9 channel widths (Hölzl et al.: 16,32,64; Klause et al.'s ResNet9: 64,128,256)",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="expected batch size (Poisson sampling)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="stop after this many steps (0: no limit)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    return parser.parse_args()


def load_data(args: argparse.Namespace, split: str) -> TensorDataset:
    """(images in [0, 1], labels); Fashion-MNIST's 28x28 digits are zero-padded to 32x32."""
    if args.fashion_mnist is None:
        generator = torch.Generator().manual_seed(0 if split == "train" else 1)
        n = args.num_examples or 1024
        return TensorDataset(
            torch.rand(n, 1, 32, 32, generator=generator), torch.randint(0, 10, (n,), generator=generator)
        )
    from equiconvert.data import load_dataset

    data = load_dataset("fashion-mnist", args.fashion_mnist, split=split)  # uint8 (N, 1, 28, 28)
    images, labels = data.images, data.labels
    if split == "train" and args.num_examples:
        images, labels = images[: args.num_examples], labels[: args.num_examples]
    # The converted ResNet9 is exactly equivariant at sizes 0 mod 8: pad 28 -> 32 (2 pixels a side).
    return TensorDataset(F.pad(images.float() / 255.0, (2, 2, 2, 2)), labels)


def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=512):
            correct += int((model(x).argmax(1) == y).sum())
    model.train()
    return correct / len(data)


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    train = load_data(args, "train")
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)

    model = resnet9(num_classes=10, in_channels=1, widths=tuple(int(w) for w in args.widths.split(",")))
    # THE ONE LINE: everything else in this script is the non-equivariant Opacus script.
    model = equiconvert.make_equivariant(model, group="D4", head="invariant")
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=train_loader,
        noise_multiplier=args.noise_multiplier,
        max_grad_norm=args.max_grad_norm,
    )

    step = 0
    for epoch in range(args.epochs):
        for x, y in train_loader:  # Poisson-sampled batches of varying size
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()  # clips each example's gradient, adds noise, steps
            step += 1
            print(f"epoch {epoch} step {step}: batch {len(y)}, loss {loss.item():.4f}")
            if step == args.steps:
                break
        if step == args.steps:
            break

    print(f"epsilon: {privacy_engine.get_epsilon(args.delta):.4f} (delta {args.delta:g}, {step} steps)")
    if args.fashion_mnist is not None:
        print(f"test accuracy: {accuracy(model, load_data(args, 'test')):.4f}")


if __name__ == "__main__":
    main()
