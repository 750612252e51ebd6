"""What does training on a JPEG copy of CIFAR-10 cost? Accuracy against generations of the same compression.

The CIFAR-10 copy here is JPEG quality 75 (4:2:0); the paper trained on the lossless images, which are not here.
The experiment adds k more generations of the same compression (k = 0, 1, 2, 3): each generation shifts the
image by a few pixels (so that the 8x8 / 16x16 block grid no longer lines up with the previous one and the
encoder throws away fresh detail), encodes it at quality 75, decodes it and shifts it back. Each generation adds
about the distortion one q75 encoding adds to an uncompressed image (its mean squared error against the images it
started from is recorded), so accuracy against k, extrapolated to k = -1, estimates training on the lossless
images; the cost of the copy is acc(-1) - acc(0). The fit is a least-squares line over the runs (seeds as
repeats); its standard error says how sure the estimate is, and the recorded per-generation errors show how well
"one generation = one original encoding" holds (a generation that adds less than the first would make the
estimate a lower bound).

Both a non-private arm (plain SGD, crops and flips) and a private arm (DPTrainer, Poisson sampling, clipping,
secret noise) train the same model on each generation; the private arm once per target epsilon (`--epsilons`),
since the copy's cost may change with the noise.

    python benchmarks/jpeg_generations.py --data-dir DIR --generations 0,1,2,3 --seeds 0,1 --device cuda \\
        --out benchmarks/results/jpeg_generations.json

`--tiny` trains a few steps on 512 images (the CPU test).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import json
import math
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import scipy.stats
import torch
import torch.nn.functional as F
from PIL import Image

from equiconvert.data import load_dataset
from equiconvert.models.equivariant_resnet9 import equivariant_resnet9
from equiconvert.training import DPTrainer

QUALITY = 75  # the copy's own quality: every generation repeats its compression
SHIFTS = ((4, 4), (2, 6), (6, 2), (3, 5))  # block-grid offsets of generations 1, 2, ...


def one_generation(images: np.ndarray, shift: tuple[int, int], quality: int = QUALITY) -> np.ndarray:
    """Images (N, H, W, C) uint8 rolled by `shift`, JPEG-encoded at `quality` (PIL's 4:2:0), decoded, rolled back."""
    out = np.empty_like(images)
    for i, image in enumerate(images):
        rolled = np.roll(image, shift, axis=(0, 1))
        buffer = io.BytesIO()
        Image.fromarray(rolled).save(buffer, "JPEG", quality=quality)
        decoded = np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))
        out[i] = np.roll(decoded, (-shift[0], -shift[1]), axis=(0, 1))
    return out


def generations(
    images: torch.Tensor, count: int, workers: int, shifts: Sequence[tuple[int, int]] = SHIFTS
) -> tuple[list[torch.Tensor], list[float]]:
    """[images after k generations for k = 0..count] (N, C, H, W uint8) and each generation's added MSE (0-255);
    generation k shifts the block grid by shifts[k - 1]."""
    current = images.permute(0, 2, 3, 1).contiguous().numpy()
    chunks = max(1, workers)
    result, added = [images], []
    for k in range(count):
        parts = np.array_split(current, chunks)
        with ProcessPoolExecutor(max_workers=chunks) as pool:
            encoded = np.concatenate(list(pool.map(one_generation, parts, [shifts[k % len(shifts)]] * len(parts))))
        added.append(float(((encoded.astype(np.float64) - current.astype(np.float64)) ** 2).mean()))
        current = encoded
        result.append(torch.from_numpy(encoded).permute(0, 3, 1, 2).contiguous())
    return result, added


def normalise(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255 - 0.5) / 0.5


def crop_flip(batch: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random crops padded by an eighth of the side (4 pixels at 32) and horizontal flips, on the batch's device."""
    n, _, h, w = batch.shape
    pad = h // 8
    padded = F.pad(batch, (pad, pad, pad, pad))
    dy, dx = (torch.randint(0, 2 * pad + 1, (n,), generator=generator) for _ in range(2))
    rows = (torch.arange(h)[None, :] + dy[:, None]).to(batch.device)
    cols = (torch.arange(w)[None, :] + dx[:, None]).to(batch.device)
    out = padded[
        torch.arange(n, device=batch.device)[:, None, None, None],
        torch.arange(batch.shape[1], device=batch.device)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]
    flip = (torch.rand(n, generator=generator) < 0.5).to(batch.device)
    return torch.where(flip[:, None, None, None], out.flip(-1), out)


@torch.no_grad()
def accuracy(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, device: str) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(images), 1000):
        x = normalise(images[start : start + 1000].to(device))
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=device != "cpu"):
            correct += int((model(x).argmax(1).cpu() == labels[start : start + 1000]).sum())
    return correct / len(images)


def train_nonprivate(train, test, seed: int, epochs: int, device: str) -> float:
    """Plain SGD (momentum 0.9, cosine, weight decay 5e-4, batch 512) with crops and flips; test accuracy."""
    torch.manual_seed(seed)
    images, labels = train
    model = equivariant_resnet9("D4", input_size=images.shape[-1]).to(device)
    steps = epochs * math.ceil(len(images) / 512)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=steps)
    generator = torch.Generator().manual_seed(seed)
    images_dev, labels_dev = images.to(device), labels.to(device)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(images), generator=generator).to(device)
        for start in range(0, len(images), 512):
            index = order[start : start + 512]
            x = normalise(crop_flip(images_dev[index].float(), generator))
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=device != "cpu"):
                loss = F.cross_entropy(model(x), labels_dev[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    return accuracy(model, *test, device)


def train_private(train, test, seed: int, options: dict, device: str) -> float:
    """DPTrainer with `options` (DPConfig fields); the final test accuracy of its EMA weights."""
    torch.manual_seed(seed)
    model = equivariant_resnet9("D4", input_size=train[0].shape[-1])
    trainer = DPTrainer(model, device=device, progress=False, seed=seed, **options)
    trainer.fit(train, eval_set=test)
    return float(trainer.history[-1]["final_eval"]["accuracy"])


def fit_line(points: Sequence[tuple[int, float]]) -> dict[str, float | None]:
    """Least squares acc = a + b k over (k, acc) points; the value at k = -1 and the cost acc(-1) - acc(0), with SEs
    (None from two points: a line through them leaves no residual to estimate the spread from)."""
    k = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    design = np.stack([np.ones_like(k), k], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    at_minus_one = coef[0] - coef[1]
    slope_se = at_minus_one_se = None
    if len(y) > 2:
        sigma2 = float(((y - design @ coef) ** 2).sum() / (len(y) - 2))
        cov = sigma2 * np.linalg.inv(design.T @ design)
        slope_se = math.sqrt(cov[1, 1])
        at_minus_one_se = math.sqrt(cov[0, 0] + cov[1, 1] - 2 * cov[0, 1])
    return {
        "intercept": float(coef[0]),
        "slope_per_generation": float(coef[1]),
        "slope_se": slope_se,
        "lossless_estimate": float(at_minus_one),
        "lossless_estimate_se": at_minus_one_se,
        "cost_of_copy": float(-coef[1]),
        "cost_of_copy_se": slope_se,
    }


def mse_based_cost(points: Sequence[tuple[int, float]], added_mse: Sequence[float]) -> dict[str, float | None]:
    """Accuracy as a line in the cumulative added MSE; the cost of one more encoding of the first generation's MSE.

    Later generations add less distortion than the first (the copy loses detail each time), and an encoding of
    the lossless images removes at least as much as the first generation: the cost is a lower bound.
    """
    cumulative = np.concatenate([[0.0], np.cumsum(added_mse)])
    x = np.array([cumulative[g] for g, _ in points])
    y = np.array([acc for _, acc in points])
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    lower_bound_se = None  # as fit_line's: none from two points
    if len(y) > 2:
        sigma2 = float(((y - design @ coef) ** 2).sum() / (len(y) - 2))
        lower_bound_se = math.sqrt(sigma2 * np.linalg.inv(design.T @ design)[1, 1]) * added_mse[0]
    return {
        "slope_per_mse": float(coef[1]),
        "cost_of_copy_lower_bound": float(-coef[1] * added_mse[0]),
        "cost_of_copy_lower_bound_se": lower_bound_se,
    }


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The options this ladder and jpeg_first_encoding.py's share: what trains, on which device, and where it goes."""
    parser.add_argument("--data-dir", help="the CIFAR-10 copy (ImageFolder or pickle layout)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--arms", default="nonprivate,private")
    parser.add_argument("--epochs", type=int, default=15, help="non-private epochs")
    parser.add_argument("--private-steps", type=int, default=300)
    parser.add_argument("--private-batch", type=int, default=4096)
    parser.add_argument("--epsilons", default="8", help="the private arm's target epsilons, comma-separated")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=8, help="processes for the JPEG encoding")
    parser.add_argument("--tiny", action="store_true", help="512 training and 256 test images, a few steps (tests)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge these summaries into --out, train nothing")


def load_copy(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels) of the copy; with --tiny 512 / 256 random images and
    a few steps of training (the options are shortened in place)."""
    train, test = (load_dataset("cifar10", args.data_dir, split=s) for s in ("train", "test"))
    train_x, train_y, test_x, test_y = train.images, train.labels, test.images, test.labels
    if args.tiny:
        keep_train, keep_test = torch.randperm(len(train_x))[:512], torch.randperm(len(test_x))[:256]
        train_x, train_y, test_x, test_y = (
            train_x[keep_train],
            train_y[keep_train],
            test_x[keep_test],
            test_y[keep_test],
        )
        args.epochs, args.private_steps, args.private_batch = 1, 3, max(4, len(train_x) // 4)
    return train_x, train_y, test_x, test_y


def private_options(args: argparse.Namespace) -> dict:
    """The private arm's DPConfig fields (its target epsilon is added per run)."""
    return {
        "delta": 1e-5,
        "batch_size": args.private_batch,
        "steps": args.private_steps,
        "aug_mult": 1,
        "lr": 2.0,
        "max_grad_norm": 2.0,
        "ema_decay": 0.999,
        "physical_batch_size": min(args.private_batch, 1024),
        "precision": "bf16" if args.device.startswith("cuda") else "fp32",
    }


def train_arms(
    args: argparse.Namespace,
    generation: int,
    train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
    summary: dict,
    write: Callable[[dict, Path], None],
) -> None:
    """Train every (seed, arm, epsilon) on one generation, appending each run to summary["runs"] and writing the
    summary after each (a cut-short call keeps its runs)."""
    options = private_options(args)
    for seed in (int(s) for s in args.seeds.split(",")):
        for arm in args.arms.split(","):
            for epsilon in [None] if arm == "nonprivate" else [float(e) for e in args.epsilons.split(",")]:
                if epsilon is None:
                    acc = train_nonprivate(train, test, seed, args.epochs, args.device)
                else:
                    acc = train_private(train, test, seed, options | {"target_epsilon": epsilon}, args.device)
                run = {"arm": arm, "generation": generation, "seed": seed, "accuracy": acc}
                summary["runs"].append(run if epsilon is None else run | {"epsilon": epsilon})
                print(json.dumps(summary["runs"][-1]), flush=True)
                write(summary, Path(args.out))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    parser.add_argument("--generations", default="0,1,2,3", help="extra q75 generations to train on")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    wanted = sorted({int(g) for g in args.generations.split(",")})
    train_x, train_y, test_x, test_y = load_copy(args)
    train_gens, train_mse = generations(train_x, max(wanted), args.workers)
    test_gens, test_mse = generations(test_x, max(wanted), args.workers)
    summary = {
        "command": "python benchmarks/jpeg_generations.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": _dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        "quality": QUALITY,
        "added_mse_per_generation": {"train": train_mse, "test": test_mse},
        "non_private": {"model": "D4 Equivariant-ResNet9", "epochs": args.epochs, "optimizer": "SGD 0.1 one-cycle"},
        "private": private_options(args) | {"epsilons": [float(e) for e in args.epsilons.split(",")]},
        "runs": [],
    }
    for generation in wanted:
        train_arms(
            args, generation, (train_gens[generation], train_y), (test_gens[generation], test_y), summary, write_summary
        )


def pooled_cost(runs: Sequence[dict]) -> dict | None:
    """One per-generation cost for the private arms at all their epsilons: least squares with an intercept per
    (arm, seed) and one slope, its standard error from the residuals, and the F-test's p-value for one slope per
    arm instead (a small p says the cost depends on epsilon and pooling hides it). None without two such arms.

    Every (arm, seed) run of the ladder weighs the same: a 4-point line's own residual SE is too rough to weight by
    (a single-seed arm can fit a line by chance)."""
    private = [r for r in runs if r["arm"] != "nonprivate"]
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in private:
        groups.setdefault((arm_of(r), r["seed"]), []).append((float(r["generation"]), 100 * r["accuracy"]))
    groups = {key: points for key, points in groups.items() if len({k for k, _ in points}) > 1}
    arms = sorted({arm for arm, _ in groups})
    if len(arms) < 2:
        return None
    centred = {
        key: [(k - statistics.fmean(x for x, _ in pts), y - statistics.fmean(y for _, y in pts)) for k, y in pts]
        for key, pts in groups.items()
    }

    def slope_and_residual(keys: list[tuple[str, int]]) -> tuple[float, float]:
        points = [p for key in keys for p in centred[key]]
        slope = sum(k * y for k, y in points) / sum(k * k for k, _ in points)
        return slope, sum((y - slope * k) ** 2 for k, y in points)

    slope, common_rss = slope_and_residual(list(centred))
    n = sum(len(points) for points in centred.values())
    common_dof = n - len(centred) - 1
    per_arm_rss = sum(slope_and_residual([key for key in centred if key[0] == arm])[1] for arm in arms)
    per_arm_dof = common_dof - (len(arms) - 1)
    sxx = sum(k * k for points in centred.values() for k, _ in points)
    se = math.sqrt(common_rss / common_dof / sxx) if common_dof > 0 else None
    p_value = None
    if per_arm_dof > 0 and per_arm_rss > 0:
        f_stat = ((common_rss - per_arm_rss) / (len(arms) - 1)) / (per_arm_rss / per_arm_dof)
        p_value = float(scipy.stats.f.sf(f_stat, len(arms) - 1, per_arm_dof))
    return {
        "cost_of_copy": -slope,
        "cost_of_copy_se": se,
        "arms": arms,
        "arm_seeds": len(centred),
        "one_slope_per_arm_p": p_value,
    }


def arm_of(run: dict) -> str:
    """A run's group in the fits: "nonprivate", or the private arm with its epsilon ("private, epsilon 8")."""
    return run["arm"] if "epsilon" not in run else f"{run['arm']}, epsilon {run['epsilon']:g}"


def write_summary(summary: dict, out: Path) -> None:
    """Add the per-generation medians and the fits (with two generations or more) and write `out`."""
    runs = summary["runs"]
    arms = sorted({arm_of(r) for r in runs})
    summary["medians_percent"] = {
        arm: {
            g: statistics.median(100 * r["accuracy"] for r in runs if arm_of(r) == arm and r["generation"] == g)
            for g in sorted({r["generation"] for r in runs if arm_of(r) == arm})
        }
        for arm in arms
    }
    summary["fit_percent"] = {
        arm: fit_line([(r["generation"], 100 * r["accuracy"]) for r in runs if arm_of(r) == arm])
        for arm in arms
        if len({r["generation"] for r in runs if arm_of(r) == arm}) > 1
    }
    added = [0.0, *summary["added_mse_per_generation"]["train"]]
    summary["rows"] = [
        {"generation": g, "added_mse_train": added[g] if g < len(added) else None}
        | {arm: summary["medians_percent"][arm].get(g) for arm in arms}
        for g in sorted({r["generation"] for r in runs})
    ]
    first_mse = (
        summary["added_mse_per_generation"]["train"][0] if summary["added_mse_per_generation"]["train"] else None
    )
    summary["cost_by_distortion_percent"] = {
        arm: mse_based_cost(
            [(r["generation"], 100 * r["accuracy"]) for r in runs if arm_of(r) == arm],
            summary["added_mse_per_generation"]["train"],
        )
        for arm in summary["fit_percent"]
        if first_mse is not None
    }
    summary["pooled_private_cost_percent"] = pooled_cost(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["fit_percent"], indent=2))


def merge(parts: Sequence[str], out: str) -> None:
    """One summary from the summaries of runs made in parallel (one process per generation, say)."""
    loaded = [json.loads(Path(p).read_text()) for p in parts]
    for part in loaded:  # a summary written for one epsilon names it in its private options, not in its runs
        single = part["private"].get("target_epsilon")
        part["runs"] = [
            run | {"epsilon": single} if run["arm"] == "private" and "epsilon" not in run and single else run
            for run in part["runs"]
        ]
    summary = {**loaded[0], "runs": [run for part in loaded for run in part["runs"]]}
    summary["private"] = {key: value for key, value in summary["private"].items() if key != "target_epsilon"}
    summary["private"]["epsilons"] = sorted({run["epsilon"] for run in summary["runs"] if "epsilon" in run})
    longest = max(loaded, key=lambda part: len(part["added_mse_per_generation"]["train"]))
    summary["added_mse_per_generation"] = longest["added_mse_per_generation"]
    summary["command"] = " ; ".join(part["command"] for part in loaded)
    write_summary(summary, Path(out))


if __name__ == "__main__":
    main()
