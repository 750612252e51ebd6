"""Private fine-tuning of a pretrained CNN, plain or canonicalised, against a converted model from scratch.

A small GroupNorm CNN is pretrained without privacy on public data, then each of four models is fine-tuned
with DP-SGD (DPTrainer) on private data of another kind (--task):
  digits:        public: Fashion-MNIST (all 60,000); private: upright MNIST digits (mnist-10k.npz, its fixed
                 8,000 / 2,000 split). A quarter turn maps a 6 onto a 9, which costs any invariant model there.
  fashion_split: public: Fashion-MNIST's classes 0-4 (tops, trousers, dresses, coats); private: its classes
                 5-9 (sandals, shirts, sneakers, bags, ankle boots; 30,000 training and 5,000 test images).
The four models:
  scratch_converted:        the same CNN, freshly initialised, converted by make_equivariant (invariant head);
  pretrained:               the pretrained CNN as it is;
  pretrained_carried:       the pretrained CNN converted with one regular field per channel and its weights carried
                            by equiconvert.carry_weights: at the start, the group average of the pretrained CNN (up
                            to its GroupNorms, which pool statistics over whole fields; carry_logit_error measures it);
  pretrained_canonicalized: the pretrained CNN behind equiconvert.canonicalize, trained with pose_prior_loss;
                            its canonicaliser is first taught the upright pose on the public data (the prior
                            alone, no privacy needed), so the private steps start from a sensible pose.
Each is tested on the upright test digits and on the same digits turned by a random multiple of 90 degrees
(and flipped, for a D group). Every (epsilon, seed) cell pretrains its own CNN with that seed; cells run in
--workers parallel processes. JSON summary: every run, and per epsilon and model the median over seeds.
Usage: python benchmarks/pretrained_adaptation.py --epsilons 1,3,8 --seeds 0,1,2 --out results/adaptation.json
       python benchmarks/pretrained_adaptation.py --tiny          # a smoke run of a few steps
       ... --arms pretrained_carried --merge --out results/adaptation.json   # add one model to a summary
       ... --task fashion_split --seeds 0 --pretrain-only pretrained/   # the weights the adaptation recipes load
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

for _path in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parent):  # the package, the siblings
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from json_output import emit  # noqa: E402

from equiconvert import (  # noqa: E402
    CanonicalizedModel,
    CarryReport,
    canonicalize,
    carry_weights,
    make_equivariant,
    pose_prior_loss,
    teach_upright_pose,
)
from equiconvert.data import load_dataset, select_classes  # noqa: E402
from equiconvert.adapt.canonicalize import IDENTITY  # noqa: E402
from equiconvert.adapt.carry import convert_for_carrying  # noqa: E402
from equiconvert.models import SmallCNN  # noqa: E402
from equiconvert.groups import parse_group  # noqa: E402
from equiconvert.privacy.accounting import calibrate_noise_multiplier, default_delta  # noqa: E402
from equiconvert.training.trainer import DPTrainer  # noqa: E402

SIZE, MEAN, STD = 28, 0.5, 0.5  # DPTrainer's default normalisation, used for pretraining too
FULL = dict(pretrain_steps=2000, pretrain_examples=None, train_examples=None, test_examples=None, steps=600)
TINY = dict(pretrain_steps=3, pretrain_examples=256, train_examples=64, test_examples=64, steps=2)
PUBLIC_FASHION_CLASSES, PRIVATE_FASHION_CLASSES = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9)  # fashion_split's two tasks
ACCOUNTANT = "rdp"
CARRY_PROBE_IMAGES = 64  # public images on which the carried model's logit error is measured
# pretrained_canonicalized's canonicaliser (pose_transfer.py varies its fields and pool)
CANONICALIZER = {
    "in_channels": 1,
    "fields": 2,
    "kernel_size": 5,
    "pool": 2,
}


def _normalised(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255 - MEAN) / STD


def pretrain(
    images: torch.Tensor, labels: torch.Tensor, steps: int, batch_size: int, seed: int, device: str
) -> nn.Module:
    """SmallCNN trained without privacy (Adam, random batches) on public data; returned on the CPU."""
    torch.manual_seed(seed)
    model = SmallCNN().to(device).train()
    images, labels = images.to(device), labels.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(0, len(labels), (batch_size,), generator=generator).to(device)
        optimizer.zero_grad()
        F.cross_entropy(model(_normalised(images[batch])), labels[batch]).backward()
        optimizer.step()
    return model.cpu().eval()


def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    device = next(model.parameters()).device
    with torch.no_grad():
        predictions = model.eval()(_normalised(images.to(device))).argmax(-1).cpu()
    return float((predictions == labels).float().mean())


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


def noise_multiplier(args: argparse.Namespace, epsilon: float, examples: int) -> float:
    """The noise that spends `epsilon` in --steps Poisson steps of --batch-size (the same for every model)."""
    delta = default_delta(examples)
    return calibrate_noise_multiplier(epsilon, delta, args.batch_size / examples, args.steps, ACCOUNTANT)


def fine_tune(model: nn.Module, loss_fn, train, sigma: float, args: argparse.Namespace, seed: int) -> DPTrainer:
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
        momentum=args.momentum,
        max_grad_norm=1.0,
        ema_decay=None,
        epsilon_every=max(args.steps, 1),
        progress=False,
        seed=seed,
        device=args.device,
    )
    trainer.fit(train)
    return trainer


def carried(pretrained: nn.Module, group: str, public_images: torch.Tensor) -> tuple[nn.Module, CarryReport]:
    """The pretrained CNN converted with one regular field per channel, its weights carried (carry_weights), and
    the carry report: its logit error against the group-averaged CNN, measured on public images."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report's notes on the padded input size and the weights
        model = convert_for_carrying(pretrained, group, input_size=SIZE, pad_to_valid=True)
    return model, carry_weights(pretrained, model, _normalised(public_images[:CARRY_PROBE_IMAGES]))


Candidate = tuple[nn.Module, object, CarryReport | None]  # the model, its loss_fn (None: cross-entropy), its carry


def scratch_converted(
    pretrained: nn.Module, public_images: torch.Tensor, args: argparse.Namespace, seed: int
) -> Candidate:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report's notes on the padded input size
        model = make_equivariant(
            SmallCNN(),
            args.group,
            head="invariant",
            input_size=SIZE,
            pad_to_valid=True,
            config={"unit_invariants": args.unit_invariants == "on"},
        )
    return model, None, None


def pretrained_as_is(
    pretrained: nn.Module, public_images: torch.Tensor, args: argparse.Namespace, seed: int
) -> Candidate:
    return copy.deepcopy(pretrained), None, None


def pretrained_carried(
    pretrained: nn.Module, public_images: torch.Tensor, args: argparse.Namespace, seed: int
) -> Candidate:
    model, carry = carried(pretrained, args.group, public_images)
    return model, None, carry


def pretrained_canonicalized(
    pretrained: nn.Module, public_images: torch.Tensor, args: argparse.Namespace, seed: int
) -> Candidate:
    wrapped = canonicalize(copy.deepcopy(pretrained), args.group, **CANONICALIZER)
    teach_upright_pose(wrapped, _normalised(public_images), args.sizes["pose_steps"], seed=seed, device=args.device)
    return wrapped, pose_prior_loss(wrapped, weight=args.prior_weight), None


# the models each cell fine-tunes, by name; built only when --arms asks for them
ARMS = {
    "scratch_converted": scratch_converted,
    "pretrained": pretrained_as_is,
    "pretrained_carried": pretrained_carried,
    "pretrained_canonicalized": pretrained_canonicalized,
}


Split = tuple[torch.Tensor, torch.Tensor]


def digits_task(args: argparse.Namespace) -> tuple[Split, Split, Split, Split]:
    """Public Fashion-MNIST, private upright MNIST digits: (public, public test, private, private test)."""
    fashion = [load_dataset("fashion_mnist", args.fashion_dir, split=split) for split in ("train", "test")]
    digits = [load_dataset("rotated_mnist", args.mnist, split=split, max_angle=0.0) for split in ("train", "test")]
    return tuple((data.images, data.labels) for data in (*fashion, *digits))


def fashion_split_task(args: argparse.Namespace) -> tuple[Split, Split, Split, Split]:
    """Fashion-MNIST's classes 0-4 public, 5-9 private: (public, public test, private, private test)."""
    splits: list[Split] = []
    for classes in (PUBLIC_FASHION_CLASSES, PRIVATE_FASHION_CLASSES):
        for split in ("train", "test"):
            data = select_classes(load_dataset("fashion_mnist", args.fashion_dir, split=split), classes)
            splits.append((data.images, data.labels))
    return tuple(splits)


TASKS = {"digits": digits_task, "fashion_split": fashion_split_task}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fashion-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--mnist", default="/work/shared/data/mnist-10k.npz", help="mnist-10k.npz (or a folder)")
    parser.add_argument("--task", choices=sorted(TASKS), default="fashion_split", help="see the docstring")
    parser.add_argument("--group", default="C4", help="C4 or D4")
    parser.add_argument("--epsilons", default="3", help="comma-separated privacy budgets, e.g. 1,3,8")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds, e.g. 0,1,2")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2.0)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--prior-weight", type=float, default=0.5, help="pose_prior_loss's weight")
    parser.add_argument("--steps", type=int, default=None, help="DP-SGD steps (default: 600; --tiny: 2)")
    parser.add_argument("--pretrain-steps", type=int, default=None, help="default: 2000; --tiny: 3")
    parser.add_argument(
        "--unit-invariants", choices=("on", "off"), default="on", help="scratch_converted's group pooling scale"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--workers", type=int, default=1, help="cells run in this many processes at once")
    parser.add_argument("--tiny", action="store_true", help="a few steps on a few examples (a smoke test)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated models to fine-tune, of {list(ARMS)}")
    parser.add_argument("--out", default=None, help="JSON file (default: print only)")
    parser.add_argument(
        "--pretrain-only",
        metavar="DIR",
        default=None,
        help="pretrain the CNN of each seed on the task's public data, write DIR/TASK_seedS.pt (its state dict, "
        "the adapt.weights of the adaptation recipes) and fine-tune nothing",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the runs already in --out: a cell run again adds its arms to the same (epsilon, seed) run there",
    )
    args = parser.parse_args(argv)
    args.arms = args.arms.split(",")
    if unknown := [name for name in args.arms if name not in ARMS]:
        parser.error(f"--arms: unknown {unknown}; choose from {list(ARMS)}")
    if args.merge and not args.out:
        parser.error("--merge needs --out, the summary whose runs it keeps")
    args.epsilons = [float(value) for value in args.epsilons.split(",")]
    args.seeds = [int(value) for value in args.seeds.split(",")]
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    args.sizes = dict(TINY if args.tiny else FULL)
    args.sizes["pose_steps"] = args.sizes["pretrain_steps"]
    args.steps = args.sizes["steps"] if args.steps is None else args.steps
    if args.pretrain_steps is not None:
        args.sizes["pretrain_steps"] = args.pretrain_steps
    if args.tiny:
        args.batch_size = min(args.batch_size, 16)
    return args


def run_cell(args: argparse.Namespace, epsilon: float, seed: int) -> dict:
    """Pretrain with `seed`, then fine-tune each model of --arms privately at `epsilon`; their test accuracies."""
    sizes = args.sizes
    public, public_test, private, private_test = TASKS[args.task](args)
    pretrain_set = subset(*public, sizes["pretrain_examples"], seed)
    pretrained = pretrain(*pretrain_set, sizes["pretrain_steps"], 128, seed, args.device)
    train = subset(*private, sizes["train_examples"], seed)
    upright, labels = subset(*private_test, sizes["test_examples"], seed)
    rotated = turned(upright, args.group, seed + 1)

    sigma = noise_multiplier(args, epsilon, len(train[1]))
    results = {}
    for name in args.arms:
        model, loss_fn, carry = ARMS[name](pretrained, pretrain_set[0], args, seed)
        before = accuracy(model, upright, labels) if carry is not None else None
        trainer = fine_tune(model, loss_fn, train, sigma, args, seed)
        results[name] = {
            "upright_accuracy": accuracy(trainer.model, upright, labels),
            "turned_accuracy": accuracy(trainer.model, rotated, labels),
            "epsilon": trainer.epsilon,
            "steps": trainer.step,
            "per_sample_method": trainer.per_sample_method,
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
        }
        if carry is not None:  # where the carried model started: its logit error and its accuracy before fine-tuning
            results[name]["carry_logit_error"] = carry.logit_error
            results[name]["carry_logit_scale"] = carry.logit_scale
            results[name]["upright_accuracy_before_fine_tuning"] = before
            results[name]["multiply_adds"] = carry.carried_cost.multiply_adds
            results[name]["pretrained_multiply_adds"] = carry.pretrained_cost.multiply_adds
        if isinstance(trainer.model, CanonicalizedModel):
            results[name] |= pose_breakdown(trainer.model, upright, labels)
    public_test_subset = subset(*public_test, sizes["test_examples"], seed)
    return {
        "target_epsilon": epsilon,
        "seed": seed,
        "noise_multiplier": sigma,
        "pretrained_public_test_accuracy": accuracy(pretrained, *public_test_subset),
        "train_examples": len(train[1]),
        "test_examples": len(labels),
        "results": results,
    }


def pose_breakdown(model: CanonicalizedModel, upright: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Where the canonicalised model's upright accuracy goes: the share of upright images the canonicaliser keeps
    in the identity pose, the accuracy on those and on the rest, and the fine-tuned backbone's own accuracy on the
    upright images (what a canonicaliser that never turned an upright image would score)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        x = _normalised(upright.to(device))
        kept = torch.tensor([pose == model.elements[IDENTITY].name for pose in model.poses(x)])
        right = (model.eval()(x).argmax(-1).cpu() == labels).float()
        backbone_right = (model.backbone.eval()(x).argmax(-1).cpu() == labels).float()
    return {
        "upright_identity_pose_share": float(kept.float().mean()),
        "upright_accuracy_identity_posed": float(right[kept].mean()) if kept.any() else None,
        "upright_accuracy_turned_posed": float(right[~kept].mean()) if (~kept).any() else None,
        "backbone_upright_accuracy": float(backbone_right.mean()),
    }


def medians(runs: list[dict]) -> list[dict]:
    """Per epsilon and model: the median over the seeds that ran it of the upright and the turned test accuracy."""
    table = []
    for epsilon in sorted({run["target_epsilon"] for run in runs}):
        cells = [run for run in runs if run["target_epsilon"] == epsilon]
        names = [name for name in ARMS if any(name in run["results"] for run in cells)]
        for name in names:
            ran = [run for run in cells if name in run["results"]]
            row = {"epsilon": epsilon, "model": name, "seeds": [run["seed"] for run in ran]}
            for key in ("upright_accuracy", "turned_accuracy"):
                values = [run["results"][name][key] for run in ran]
                row[key] = statistics.median(values)
                row[key.replace("accuracy", "range")] = [min(values), max(values)]
            table.append(row)
    return table


def fine_tune_settings(args: argparse.Namespace) -> dict:
    """What every fine-tuning of a summary shares (--merge refuses a summary whose settings differ)."""
    return {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "momentum": args.momentum,
        "prior_weight": args.prior_weight,
        "accountant": ACCOUNTANT,
        "unit_invariants": args.unit_invariants,
    }


def summarise(args: argparse.Namespace, runs: list[dict]) -> dict:
    return {
        "task": args.task,
        "group": args.group,
        "epsilons": sorted({run["target_epsilon"] for run in runs}),
        "seeds": sorted({run["seed"] for run in runs}),
        "tiny": args.tiny,
        "device": args.device,
        "pretrain": {
            "steps": args.sizes["pretrain_steps"],
            "pose_steps": args.sizes["pose_steps"],
            "batch_size": 128,
            "optimizer": "adam 2e-3",
        },
        "fine_tune": fine_tune_settings(args),
        "table": medians(runs),
        "runs": sorted(runs, key=lambda run: (run["target_epsilon"], run["seed"])),
    }


def write(args: argparse.Namespace, runs: list[dict]) -> str:
    """The summary of the cells done so far, written to --out at once (a long grid keeps what it finished)."""
    return emit(summarise(args, runs), args.out)


def merged(earlier: list[dict], run: dict) -> list[dict]:
    """`earlier` with `run`'s arms added to its (epsilon, seed) run (which must share its noise), or `run` appended."""
    key = (run["target_epsilon"], run["seed"])
    for kept in earlier:
        if (kept["target_epsilon"], kept["seed"]) == key:
            if kept["noise_multiplier"] != run["noise_multiplier"]:
                raise SystemExit(f"--merge: epsilon {key[0]}, seed {key[1]} ran with other DP settings in --out")
            kept["results"].update(run["results"])
            return earlier
    return [*earlier, run]


def earlier_runs(args: argparse.Namespace) -> list[dict]:
    """The runs --merge keeps: those of --out, read before any cell starts (a bad file fails at once)."""
    if not args.merge or not Path(args.out).exists():
        return []
    earlier = json.loads(Path(args.out).read_text())
    same = (earlier.get("task"), earlier.get("group"), earlier.get("tiny"), earlier.get("fine_tune"))
    if same != (args.task, args.group, args.tiny, fine_tune_settings(args)):
        raise SystemExit(f"--merge: {args.out} holds another task, group, size or fine-tuning; give a new --out")
    return earlier["runs"]


def save_pretrained(args: argparse.Namespace) -> list[Path]:
    """--pretrain-only: each seed's pretrained CNN, as run_cell pretrains it, saved as a state dict."""
    folder = Path(args.pretrain_only)
    folder.mkdir(parents=True, exist_ok=True)
    public = TASKS[args.task](args)[0]
    written = []
    for seed in args.seeds:
        pretrain_set = subset(*public, args.sizes["pretrain_examples"], seed)
        pretrained = pretrain(*pretrain_set, args.sizes["pretrain_steps"], 128, seed, args.device)
        written.append(folder / f"{args.task}_seed{seed}.pt")
        torch.save(pretrained.state_dict(), written[-1])
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pretrain_only is not None:
        print("\n".join(str(path) for path in save_pretrained(args)))
        return 0
    cells = [(epsilon, seed) for epsilon in args.epsilons for seed in args.seeds]
    runs = earlier_runs(args)
    if args.workers == 1:
        for epsilon, seed in cells:
            runs = merged(runs, run_cell(args, epsilon, seed))
            text = write(args, runs)
    else:  # spawn: CUDA cannot be shared with forked children
        with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
            for future in as_completed([pool.submit(run_cell, args, epsilon, seed) for epsilon, seed in cells]):
                runs = merged(runs, future.result())
                text = write(args, runs)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
