"""Where the clipping budget goes at initialisation: each layer's share of the per-example gradient norm.

DP-SGD clips each example's whole gradient to one norm, so a layer with a large share of the squared norm
takes most of the signal that survives clipping. Under weight standardization a steerable conv's gradient
goes as 1/(its initial scale), so `init_gain` moves this budget between the convs and the classifier.
For the paper's Equivariant-ResNet9 converted to --group at each --gains value, and for the plain network
it is converted from, on --examples images of --split (one unaugmented view each): the median per-example
gradient norm, and the median share of the squared norm of the classifier and of each layer. JSON.
The split is the test split unless told: these are noise-free statistics of the images they use, so on the
training split (--split train, which warns and records "private": false) they are not private.
With --checkpoint (a DPTrainer checkpoint.pt of the paper's model converted to --group), the same at the trained
weights it holds, instead of at initialisation, with quantiles of the per-example norm: which examples a clipping
bound cuts.
Usage: python benchmarks/gradient_shares.py --dataset fashion-mnist --data-dir /usr/share/datasets/fashion-mnist \
           --group D1 --gains 1.4142,1,0.7071,0.5
       python benchmarks/gradient_shares.py --data-dir /usr/share/datasets/fashion-mnist --group D1 --examples 128 \
           --checkpoint runs/fm_d1/checkpoint.pt
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equiconvert.data import load_dataset  # noqa: E402
from equiconvert.models.equivariant_resnet9 import equivariant_resnet9, plain_paper_resnet9  # noqa: E402
from equiconvert.privacy.per_sample import per_sample_gradients  # noqa: E402
from equiconvert.recipes.build_model import pad_images, padded_size  # noqa: E402
from equiconvert.training.dp_config import DPConfig  # noqa: E402


def classifier_prefix(model: nn.Module) -> str:
    """Name prefix of the last Linear layer (the classifier)."""
    name = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    return name + "."


def shares(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """Median per-example gradient norm, and median shares of its square by classifier and by parameter tensor."""
    model.eval()
    params = {n: p.detach() for n, p in model.named_parameters()}
    grads, _ = per_sample_gradients(model, params, dict(model.named_buffers()), images.unsqueeze(1), labels)
    squares = {n: g.flatten(1).pow(2).sum(1) for n, g in grads.items()}
    total = torch.stack(list(squares.values())).sum(0)
    head = classifier_prefix(model)
    classifier = sum(s for n, s in squares.items() if n.startswith(head))
    norms = total.sqrt()
    return {
        "median_norm": float(norms.median()),
        "norm_quantiles": {str(q): float(norms.quantile(q)) for q in QUANTILES},
        "classifier_share": float((classifier / total).median()),
        "layer_shares": {n: round(float((s / total).median()), 4) for n, s in squares.items() if n.endswith("weight")},
    }


QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
SPLITS = ("test", "train")
TRAIN_SPLIT_WARNING = (
    "warning: --split train: these gradient statistics of training images are noise-free, not private; "
    "do not publish them"
)


def trained(path: str, group: str, classes: int, channels: int) -> nn.Module:
    """The paper's model converted to `group` with the weights of a DPTrainer checkpoint (not its EMA)."""
    model = equivariant_resnet9(group, classes, channels)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)["model"])
    return model


def normalized(images: torch.Tensor, size: int) -> torch.Tensor:
    """The trainer's input: padded to `size`, normalized with DPTrainer's default mean/std."""
    return (pad_images(images, size).float() / 255 - DPConfig.normalize_mean) / DPConfig.normalize_std


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--group", default="D1")
    parser.add_argument("--gains", default="1.4142,1,0.7071,0.5", help="comma-separated init gains")
    parser.add_argument("--examples", type=int, default=64)
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="test",
        help="the images measured (default test); train-split statistics are noise-free, so not private",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default=None, help="a DPTrainer checkpoint.pt: its weights, not initial ones")
    parser.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = parser.parse_args(argv)

    data = load_dataset(args.dataset, args.data_dir, split=args.split)
    images, labels = data.images[: args.examples], data.labels[: args.examples]
    channels, classes = images.shape[1], len(data.classes)
    result: dict = {"dataset": args.dataset, "split": args.split}
    if args.split == "train":
        print(TRAIN_SPLIT_WARNING, file=sys.stderr)
        result["private"] = False
    result.update(group=args.group, examples=len(labels), seed=args.seed)
    if args.checkpoint:
        model = trained(args.checkpoint, args.group, classes, channels)
        result["checkpoint"] = args.checkpoint
        result["trained"] = shares(model, normalized(images, padded_size(model, images.shape[-1])), labels)
        return _write(result, args.out)
    result["converted"] = {}
    for gain in (float(g) for g in args.gains.split(",")):
        torch.manual_seed(args.seed)
        model = equivariant_resnet9(args.group, classes, channels, init_gain=gain)
        size = padded_size(model, images.shape[-1])
        result["converted"][str(gain)] = shares(model, normalized(images, size), labels)
    torch.manual_seed(args.seed)
    result["plain"] = shares(plain_paper_resnet9(classes, channels), normalized(images, images.shape[-1]), labels)
    return _write(result, args.out)


def _write(result: dict, out: str | None) -> int:
    text = json.dumps(result, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
