"""Does the JPEG generation ladder predict what the first encoding costs? Tested where the lossless images are known.

benchmarks/jpeg_generations.py estimates what the CIFAR-10 copy's compression (JPEG quality 75, 4:2:0) costs by
adding generations of the same compression to the copy and extrapolating one generation back. Each generation adds
less distortion than the one before, so that per-generation cost is a lower bound. This benchmark measures the two
things the bound leaves open:

- distortion (no training): on lossless images, the mean squared error the first quality-75 encoding adds, against
  the error that the ladder's first generation (block grid shifted by 4) then adds to the encoded images. Their
  ratio scales the ladder's first-generation error on the copy to the error of the copy's own encoding. The
  lossless images: photographs (`--photos DIR`) shrunk by whole factors with a box filter into 32x32 and 16x16
  tiles (CIFAR's images are shrunk photographs too), and the copy itself averaged 2x2 to 16x16, which averages most
  of its compression away (how much is left is measured on the photographs: their first encoding averaged 2x2,
  against the averaged photographs).
- accuracy (`--data-dir DIR`): the copy averaged 2x2 to 16x16 stands for lossless images. The D4 model trains on it
  (generation 0), on its first encoding (1) and on two more generations (2, 3), non-privately and privately, as in
  jpeg_generations.py. The true cost of the first encoding, acc(0) - acc(1), is set against the two predictions the
  ladder makes from generations 1-3 alone: its per-generation slope, and its slope per unit of added error times
  the first encoding's error.

    python benchmarks/jpeg_first_encoding.py --photos DIR --data-dir CIFAR --generations 0,1,2,3 --seeds 0,1,2 \\
        --device cuda --out first_encoding.json

`--generations G --out partG.json` runs one generation (side by side on one card), `--merge part*.json` joins them;
`--distortion-only` skips the training; `--tiny` trains a few steps on 512 images (the CPU test).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # the package and the sibling modules, also when loaded by path
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from jpeg_generations import (  # noqa: E402
    SHIFTS,
    add_training_arguments,
    arm_of,
    fit_line,
    generations,
    load_copy,
    mse_based_cost,
    one_generation,
    private_options,
    train_arms,
)

ALIGNED = (0, 0)  # the copy's own encoding: the block grid on the image's corner
LADDER_SHIFTS = (ALIGNED, *SHIFTS)  # generation 1 is the first encoding, 2 and 3 the ladder's generations
COPY_FACTOR = 2  # the copy averaged 2x2: 16x16 images that stand for lossless ones
COPY_SIZE = 32  # the copy's images are 32x32
PHOTO_EXTENSIONS = (".png", ".jpg", ".jpeg", ".ppm", ".tif", ".tiff")
MIN_PHOTO_FACTOR = 4  # a photograph shrunk less than this keeps its own compression's detail
RGB_TO_YCBCR = np.array(  # JPEG's (JFIF's) colour transform, offsets left out: errors only
    [[0.299, 0.587, 0.114], [-0.168736, -0.331264, 0.5], [0.5, -0.418688, -0.081312]]
)
POOLED = "private, pooled"  # the ladder's one slope for all private runs: the paper table's estimate


def box_downsample(images: np.ndarray, factor: int) -> np.ndarray:
    """(N, H, W, C) uint8 images averaged over factor x factor blocks, rounded back to uint8."""
    n, h, w, c = images.shape
    blocks = images[:, : h - h % factor, : w - w % factor].astype(np.float64)
    blocks = blocks.reshape(n, h // factor, factor, w // factor, factor, c).mean(axis=(2, 4))
    return np.clip(np.rint(blocks), 0, 255).astype(np.uint8)


def photo_tiles(folder: Path, size: int) -> np.ndarray:
    """size x size RGB tiles of every photograph under `folder`, each shrunk by a box filter until its short side is
    2 and 4 tiles long (factors below MIN_PHOTO_FACTOR are skipped), cut on a grid without overlap."""
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in PHOTO_EXTENSIONS)
    if not paths:
        raise FileNotFoundError(f"--photos {folder}: no image files ({', '.join(PHOTO_EXTENSIONS)}) in it")
    tiles = []
    for path in paths:
        with Image.open(path) as opened:
            photo = opened.convert("RGB")
        for tiles_per_side in (2, 4):
            factor = min(photo.size) // (size * tiles_per_side)
            if factor < MIN_PHOTO_FACTOR:
                continue
            shrunk = np.asarray(photo.reduce(factor))
            rows, cols = shrunk.shape[0] // size, shrunk.shape[1] // size
            tiles += [
                shrunk[r * size : (r + 1) * size, q * size : (q + 1) * size] for r in range(rows) for q in range(cols)
            ]
    if not tiles:
        raise ValueError(f"--photos {folder}: no photograph is {size * 2 * MIN_PHOTO_FACTOR} pixels on its short side")
    return np.stack(tiles)


def per_image_mse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return ((a.astype(np.float64) - b.astype(np.float64)) ** 2).reshape(len(a), -1).mean(axis=1)


def channel_mse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The MSE between (N, H, W, 3) RGB images in each of JPEG's channels: luma Y and chroma Cb, Cr."""
    difference = (a.astype(np.float64) - b.astype(np.float64)) @ RGB_TO_YCBCR.T
    return (difference**2).reshape(-1, 3).mean(axis=0)


def distortion_ratio(lossless: np.ndarray) -> dict[str, float | int | dict[str, float]]:
    """The first encoding's added MSE against the next generation's on (N, H, W, C) lossless images, and their
    ratio of means with its delta-method standard error over the images; the same ratio per JPEG channel."""
    first = one_generation(lossless, ALIGNED)
    second = one_generation(first, SHIFTS[0])
    by_channel = channel_mse(first, lossless) / channel_mse(second, first)
    a, b = per_image_mse(first, lossless), per_image_mse(second, first)
    ma, mb = float(a.mean()), float(b.mean())
    ratio = ma / mb
    cov = np.cov(a, b)
    variance = ratio**2 * (cov[0, 0] / ma**2 + cov[1, 1] / mb**2 - 2 * cov[0, 1] / (ma * mb)) / len(a)
    return {
        "images": len(a),
        "first_encoding_mse": ma,
        "next_generation_mse": mb,
        "ratio": ratio,
        "ratio_se": math.sqrt(max(variance, 0.0)),
        "ratio_by_channel": dict(zip(("Y", "Cb", "Cr"), map(float, by_channel))),
    }


def averaging_residual(lossless: np.ndarray) -> dict[str, float | dict[str, float]]:
    """How lossless the averaged copy is: on (N, H, W, 3) lossless images, the MSE between the COPY_FACTOR-averaged
    first encoding and the averaged images, against the MSE one first encoding adds to the averaged images."""
    averaged = box_downsample(lossless, COPY_FACTOR)
    residual = box_downsample(one_generation(lossless, ALIGNED), COPY_FACTOR)
    encoded = one_generation(averaged, ALIGNED)
    left, added = channel_mse(residual, averaged), channel_mse(encoded, averaged)
    return {
        "residual_mse": float(per_image_mse(residual, averaged).mean()),
        "first_encoding_mse": float(per_image_mse(encoded, averaged).mean()),
        "residual_by_channel": dict(zip(("Y", "Cb", "Cr"), map(float, left))),
        "first_encoding_by_channel": dict(zip(("Y", "Cb", "Cr"), map(float, added))),
    }


def distortion(tiles: dict[int, np.ndarray], copy: np.ndarray | None) -> dict[str, dict]:
    """distortion_ratio for the photographs' tiles of each size and for the copy averaged 2x2."""
    found = {f"photographs, {size}x{size}": distortion_ratio(images) for size, images in tiles.items()}
    if copy is not None:
        found[f"CIFAR-10 copy averaged {COPY_FACTOR}x{COPY_FACTOR}"] = distortion_ratio(copy)
    return found


def nhwc(images: torch.Tensor) -> np.ndarray:
    return images.permute(0, 2, 3, 1).contiguous().numpy()


def nchw(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()


def mean_and_se(values: Sequence[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def validation(runs: Sequence[dict], added_mse: Sequence[float]) -> dict[str, dict]:
    """Per arm: the first encoding's true cost, acc(0) - acc(1) (means over seeds), against the ladder's two
    predictions from generations 1-3: the per-generation slope, and the slope per added MSE times the first
    encoding's MSE (added_mse[0]; added_mse[k] is generation k + 1's)."""
    result = {}
    for arm in sorted({arm_of(r) for r in runs}):
        by_generation = {
            g: [100 * r["accuracy"] for r in runs if arm_of(r) == arm and r["generation"] == g] for g in range(4)
        }
        if not all(by_generation.values()):
            continue
        (lossless, lossless_se), (first, first_se) = mean_and_se(by_generation[0]), mean_and_se(by_generation[1])
        ladder = [(g - 1, acc) for g in (1, 2, 3) for acc in by_generation[g]]
        per_generation = fit_line(ladder)
        slope_per_mse = mse_based_cost(ladder, added_mse[1:])["slope_per_mse"]
        true_cost = lossless - first
        result[arm] = {
            "lossless": lossless,
            "first_encoding": first,
            "true_cost": true_cost,
            "true_cost_se": math.hypot(lossless_se, first_se) if lossless_se is not None else None,
            "predicted_per_generation": per_generation["cost_of_copy"],
            "predicted_per_generation_se": per_generation["cost_of_copy_se"],
            "slope_per_mse": slope_per_mse,
            "predicted_by_distortion": -slope_per_mse * added_mse[0],
        }
    return result


def train_ladder(
    args: argparse.Namespace, copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], summary: dict
) -> None:
    """Train every (generation, seed, arm) of the 16x16 ladder on `copy` (load_copy's), writing the summary after
    each run."""
    train_x, train_y, test_x, test_y = copy
    wanted = sorted({int(g) for g in args.generations.split(",")})
    lossless_train, lossless_test = (nchw(box_downsample(nhwc(x), COPY_FACTOR)) for x in (train_x, test_x))
    train_gens, train_mse = generations(lossless_train, max(wanted), args.workers, LADDER_SHIFTS)
    test_gens, _ = generations(lossless_test, max(wanted), args.workers, LADDER_SHIFTS)
    summary["added_mse_per_generation"] = train_mse
    summary["non_private"] = {"epochs": args.epochs, "optimizer": "SGD 0.1 one-cycle"}
    summary["private"] = private_options(args) | {"epsilons": [float(e) for e in args.epsilons.split(",")]}
    for generation in wanted:
        train_arms(
            args, generation, (train_gens[generation], train_y), (test_gens[generation], test_y), summary, write_summary
        )


def first_encoding_factor(arms: dict[str, dict]) -> dict[str, float | None] | None:
    """How many ladder generations the first encoding is worth in accuracy: the private arms' true costs summed over
    their predicted per-generation costs summed, with a delta-method standard error (None without one per arm);
    None without a private arm or where the ladder predicts no cost at all."""
    private = [v for arm, v in arms.items() if arm != "nonprivate"]
    predicted = sum(v["predicted_per_generation"] for v in private)
    if not private or predicted == 0:
        return None
    true = sum(v["true_cost"] for v in private)
    ses = [(v["true_cost_se"], v["predicted_per_generation_se"]) for v in private]
    factor = true / predicted
    se = None
    if all(t is not None and p is not None for t, p in ses):
        true_var, predicted_var = sum(t**2 for t, _ in ses), sum(p**2 for _, p in ses)
        se = math.sqrt(true_var + factor**2 * predicted_var) / abs(predicted)
    return {"factor": factor, "factor_se": se, "arms": len(private)}


def carried_over(ladder_fits: dict[str, dict], factor: dict[str, float | None]) -> dict[str, dict]:
    """Each private arm of the 32x32 ladder: its per-generation cost times the first-encoding factor, the estimated
    cost of the copy's own encoding, with the two standard errors combined (None where either is missing)."""
    result = {}
    for arm, fit in ladder_fits.items():
        if arm == "nonprivate":
            continue
        cost = fit["cost_of_copy"] * factor["factor"]
        se = None
        if fit["cost_of_copy_se"] is not None and factor["factor_se"] is not None:
            se = math.hypot(fit["cost_of_copy_se"] * factor["factor"], fit["cost_of_copy"] * factor["factor_se"])
        result[arm] = {"ladder_cost": fit["cost_of_copy"], "estimated_cost": cost, "estimated_cost_se": se}
    return result


def generation_rows(runs: Sequence[dict], added_mse: Sequence[float]) -> list[dict]:
    """Per generation: the error it added (none for the lossless images) and each arm's mean accuracy over seeds."""
    arms = sorted({arm_of(r) for r in runs})
    rows = []
    for g in sorted({r["generation"] for r in runs}):
        means = {arm: [100 * r["accuracy"] for r in runs if arm_of(r) == arm and r["generation"] == g] for arm in arms}
        added = added_mse[g - 1] if 0 < g <= len(added_mse) else None
        rows.append(
            {"generation": g, "added_mse_train": added}
            | {a: statistics.fmean(v) if v else None for a, v in means.items()}
        )
    return rows


def write_summary(summary: dict, out: Path) -> None:
    if summary.get("runs") and summary.get("added_mse_per_generation"):
        summary["rows"] = generation_rows(summary["runs"], summary["added_mse_per_generation"])
        summary["validation_percent"] = validation(summary["runs"], summary["added_mse_per_generation"])
        summary["first_encoding_factor"] = first_encoding_factor(summary["validation_percent"])
        if summary.get("ladder_fits") and summary["first_encoding_factor"]:
            summary["carried_over_percent"] = carried_over(summary["ladder_fits"], summary["first_encoding_factor"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")


def merge(parts: Sequence[str], out: str, ladder: Path | None = None) -> None:
    """One summary from parts run side by side: their runs joined, the longest error list, every distortion measured,
    and with `ladder` (a jpeg_generations.py summary at 32x32) the first-encoding factor carried over to its costs."""
    loaded = [json.loads(Path(p).read_text()) for p in parts]
    summary = dict(loaded[0])
    summary["runs"] = [run for part in loaded for run in part.get("runs", [])]
    summary["command"] = " ; ".join(part["command"] for part in loaded)
    summary["distortion"] = {name: found for part in loaded for name, found in part.get("distortion", {}).items()}
    summary["added_mse_per_generation"] = max((part.get("added_mse_per_generation", []) for part in loaded), key=len)
    for settings in ("non_private", "private", "averaged_copy_residual"):
        found = next((part[settings] for part in loaded if settings in part), None)
        if found is not None:
            summary[settings] = found
    if "private" in summary:
        epsilons = sorted({run["epsilon"] for run in summary["runs"] if "epsilon" in run})
        summary["private"] = summary["private"] | {"epsilons": epsilons}
    summary.pop("validation_percent", None)
    if ladder is not None:
        ladder_summary = json.loads(ladder.read_text())
        summary["ladder_fits"] = ladder_summary["fit_percent"]
        if ladder_summary.get("pooled_private_cost_percent"):
            summary["ladder_fits"][POOLED] = ladder_summary["pooled_private_cost_percent"]
    write_summary(summary, Path(out))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    parser.add_argument("--photos", type=Path, help="a folder of photographs (lossless, or large enough to shrink)")
    parser.add_argument("--distortion-only", action="store_true", help="measure the errors, train nothing")
    parser.add_argument("--generations", default="0,1,2,3", help="0 lossless, 1 the first encoding, 2-3 the ladder")
    parser.add_argument("--ladder", type=Path, help="with --merge: the 32x32 ladder's summary to carry the factor to")
    args = parser.parse_args(argv)
    if args.ladder is not None and not args.merge:
        parser.error("--ladder goes with --merge")
    if args.merge:
        return merge(args.merge, args.out, args.ladder)
    if args.photos is None and args.data_dir is None:
        parser.error("give --photos DIR, --data-dir DIR or both")
    if args.photos is not None and not args.photos.is_dir():
        parser.error(f"--photos {args.photos}: not a folder")
    data = load_copy(args) if args.data_dir is not None else None
    averaged = None if data is None else box_downsample(nhwc(data[0][:10_000]), COPY_FACTOR)
    tiles = {} if args.photos is None else {size: photo_tiles(args.photos, size) for size in (COPY_SIZE, 16)}
    summary = {
        "command": "python benchmarks/jpeg_first_encoding.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": _dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "distortion": distortion(tiles, averaged),
        "runs": [],
    }
    if args.photos is not None:
        summary["averaged_copy_residual"] = averaging_residual(tiles[COPY_SIZE])
    write_summary(summary, Path(args.out))
    if data is not None and not args.distortion_only:
        train_ladder(args, data, summary)


if __name__ == "__main__":
    main()
