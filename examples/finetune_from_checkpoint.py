"""Fine-tune your own converted model with differential privacy, starting from its checkpoint.

The usual private-training recipe: a model trained on public data (saved with ``equiconvert.save``) is
fine-tuned on the private data set with DP-SGD, and the result is saved the same way.

    python examples/finetune_from_checkpoint.py                       # a stand-in checkpoint, synthetic data
    python examples/finetune_from_checkpoint.py --checkpoint public.pt --dataset cifar10 --data-dir DIR \
        --epsilon 8 --batch-size 1024 --steps 200 --device cuda --out runs/finetuned.pt

Without ``--checkpoint`` the script builds and saves an untrained D4 ResNet9 as a stand-in for your own. The
checkpoint is read with ``equiconvert.load`` (weights_only: a file is never executed), which rebuilds the model
from its recipe and refuses coefficients saved for other steerable bases.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import equiconvert
from equiconvert.data import load_dataset
from equiconvert.training import DPTrainer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="a file written by equiconvert.save")
    parser.add_argument("--dataset", default="synthetic", help="the private data set (a registered name)")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--epsilon", type=float, default=8.0, help="target epsilon of the fine-tuning")
    parser.add_argument("--delta", type=float, default=None, help="default: follows the data set size")
    parser.add_argument("--batch-size", type=int, default=32, help="expected logical batch (Poisson sampling)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="where to save the fine-tuned model")
    return parser.parse_args()


def stand_in_checkpoint(folder: Path) -> Path:
    """An untrained D4 ResNet9, saved as a user's pretrained model would be."""
    model = equiconvert.make_equivariant(equiconvert.create_model("resnet9", widths=(8, 16, 32)), "D4")
    path = folder / "stand_in.pt"
    equiconvert.save(model, path)
    return path


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = args.checkpoint or stand_in_checkpoint(Path(scratch))
        model = equiconvert.load(checkpoint)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        train = load_dataset(args.dataset, args.data_dir, split="train")
        trainer = DPTrainer(
            model,
            target_epsilon=args.epsilon,
            delta=args.delta,
            batch_size=args.batch_size,
            steps=args.steps,
            lr=args.lr,
            max_grad_norm=args.max_grad_norm,
            aug_mult=1,
            physical_batch_size=args.batch_size,
            ema_decay=None,
            device=args.device,
            progress=False,
        )
        trainer.fit((train.images, train.labels))
        moved = sum(not torch.equal(before[name], p.detach().cpu()) for name, p in trainer.model.named_parameters())
        out = args.out or Path(scratch) / "finetuned.pt"
        equiconvert.save(trainer.model, out)
        reloaded = equiconvert.load(out).eval()
        probe = torch.rand(2, *train.images.shape[1:])
        same = torch.equal(reloaded(probe), trainer.model.cpu().eval()(probe))
        print(f"started from: {'stand-in' if args.checkpoint is None else checkpoint}")
        print(f"fine-tuned {trainer.step} steps at epsilon {trainer.epsilon:.3f} (delta {trainer.delta:g})")
        print(f"parameter tensors changed: {moved} of {len(before)}")
        print(f"saved to {out}; reloaded model gives identical outputs: {same}")


if __name__ == "__main__":
    main()
