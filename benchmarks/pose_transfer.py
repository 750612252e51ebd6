"""How far a canonicaliser taught the upright pose on public images carries it to private images of other kinds.

pretrained_adaptation.py's canonicalised model first learns the upright pose on the public images alone (no
privacy needed), then fine-tunes with DP-SGD and pose_prior_loss on the private ones. This measures the first
part: after teaching (teach_upright_pose, Adam) with each setting of --fields and --pose-steps, the share of
upright test images that the canonicaliser leaves in the identity pose, on the public classes it was taught and
on the private task's images, which it never saw. No private training, no privacy cost.
Usage: python benchmarks/pose_transfer.py --task fashion_split --fields 2,4 --pose-steps 500,2000,8000 --seeds 0,1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

from json_output import emit  # noqa: E402
from pretrained_adaptation import CANONICALIZER, TASKS, _normalised, subset  # noqa: E402

from equiconvert import canonicalize, teach_upright_pose  # noqa: E402
from equiconvert.adapt.canonicalize import IDENTITY  # noqa: E402
from equiconvert.models import SmallCNN  # noqa: E402


def identity_share(model, images: torch.Tensor) -> float:
    """The share of `images` that the canonicaliser of `model` leaves in the identity pose."""
    poses = model.poses(_normalised(images))
    return poses.count(model.elements[IDENTITY].name) / len(poses)


def measure(args: argparse.Namespace, fields: int, steps: int, seed: int, splits) -> dict:
    public, public_test, _, private_test = splits
    torch.manual_seed(seed)
    model = canonicalize(SmallCNN(), args.group, **{**CANONICALIZER, "fields": fields, "pool": args.pool})
    teach_upright_pose(model, _normalised(public[0]), steps, seed=seed, device="cpu")
    return {
        "fields": fields,
        "pose_steps": steps,
        "seed": seed,
        "public_identity_share": identity_share(model, subset(*public_test, args.test_examples, seed)[0]),
        "private_identity_share": identity_share(model, subset(*private_test, args.test_examples, seed)[0]),
    }


def table(runs: list[dict]) -> list[dict]:
    """Per (fields, pose steps): the median over seeds of both shares."""
    rows = []
    for fields, steps in sorted({(run["fields"], run["pose_steps"]) for run in runs}):
        ran = [run for run in runs if (run["fields"], run["pose_steps"]) == (fields, steps)]
        row = {"fields": fields, "pose_steps": steps, "seeds": [run["seed"] for run in ran]}
        for key in ("public_identity_share", "private_identity_share"):
            row[key] = statistics.median(run[key] for run in ran)
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fashion-dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--mnist", default="/work/shared/data/mnist-10k.npz", help="mnist-10k.npz (or a folder)")
    parser.add_argument("--task", choices=sorted(TASKS), default="fashion_split")
    parser.add_argument("--group", default="C4", help="C4 or D4")
    parser.add_argument(
        "--fields", default=str(CANONICALIZER["fields"]), help="comma-separated canonicaliser widths (regular fields)"
    )
    parser.add_argument("--pose-steps", default="2000", help="comma-separated Adam steps of teaching")
    parser.add_argument("--pool", type=int, default=CANONICALIZER["pool"], help="the canonicaliser's input pooling")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--test-examples", type=int, default=1000, help="upright test images per split")
    parser.add_argument("--out", default=None, help="JSON file (default: print only)")
    args = parser.parse_args(argv)
    try:
        args.fields = [int(v) for v in args.fields.split(",")]
        args.pose_steps = [int(v) for v in args.pose_steps.split(",")]
        args.seeds = [int(v) for v in args.seeds.split(",")]
    except ValueError as error:
        parser.error(f"--fields, --pose-steps and --seeds take comma-separated whole numbers ({error})")
    if min(args.fields) < 1 or min(args.pose_steps) < 0 or args.test_examples < 1:
        parser.error("--fields and --test-examples must be >= 1, --pose-steps >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    splits = TASKS[args.task](args)
    runs = [
        measure(args, fields, steps, seed, splits)
        for fields in args.fields
        for steps in args.pose_steps
        for seed in args.seeds
    ]
    summary = {
        "task": args.task,
        "group": args.group,
        "pool": args.pool,
        "test_examples": args.test_examples,
        "command": "python benchmarks/pose_transfer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.now(timezone.utc).date().isoformat(),
        "table": table(runs),
        "runs": runs,
    }
    print(emit(summary, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
