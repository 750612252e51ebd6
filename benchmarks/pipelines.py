"""The gallery of public DP pipelines: each trained as published, converted, and widened, with its own settings.

    python benchmarks/pipelines.py --data-dir .data --out runs/pipelines \
        --pipelines opacus_cifar10,tramer_boneh_cifar10 --arms original,default,dp,widened=dp --seeds 0,1 \
        --device cuda --jobs 12 --deadline-s 540

Each (pipeline, arm, seed) trains in its own process with equiconvert's make_private (Poisson batches, the
pipeline's optimiser, clip, expected batch, epochs and epsilon; physical batches through BatchMemoryManager) and
writes OUT/runs/<pipeline>/<arm>/seed<k>.json; a run whose file exists is not run again, and a run stopped at a
call's deadline goes on from its last finished epoch (seed<k>.ckpt: model, optimizer, accountant and budget, read
with weights_only=True) when the same command runs again on the same OUT. OUT/summary.json collects every finished
run (accuracy, epsilon, parameters, wall time) and the median over seeds per arm. Images are decoded once into
OUT/data/ (uint8 tensors, read back with weights_only=True). Pipelines: benchmarks/pipeline_gallery/; arms: benchmarks/pipeline_gallery/arms.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pipeline_gallery import PIPELINES, Pipeline  # noqa: E402
from pipeline_gallery.arms import build_arm  # noqa: E402

DATA_DIRS = {"cifar10": "cifar10", "fashion-mnist": "fashion-mnist", "mnist": "mnist-10k.npz"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="folder holding cifar10/ and fashion-mnist/")
    parser.add_argument("--out", required=True)
    parser.add_argument("--pipelines", default=",".join(PIPELINES))
    parser.add_argument("--arms", default="original,default,dp")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained side by side, each in its own process")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="stop launching and end runs after this")
    parser.add_argument(
        "--epochs",
        type=float,
        default=0.0,
        help="override every pipeline's epochs (a shortened schedule, kept apart; noise recalibrated to it)",
    )
    parser.add_argument("--train-limit", type=int, default=0, help="use the first N training images (tests)")
    parser.add_argument(
        "--lr-scale", type=float, default=1.0, help="multiply every pipeline's learning rate (sensitivity runs)"
    )
    parser.add_argument("--worker", nargs=3, metavar=("PIPELINE", "ARM", "SEED"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- data ------------------------------------------------------------------------------------------------------


def cached_split(args: argparse.Namespace, dataset: str, split: str) -> Path:
    """uint8 images and int64 labels of one split, decoded once into OUT/data/."""
    path = Path(args.out) / "data" / f"{dataset}-{split}.pt"
    if not path.exists():
        from equiconvert.data import load_dataset

        data = load_dataset(dataset, Path(args.data_dir) / DATA_DIRS[dataset], split=split)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"images": data.images.contiguous(), "labels": data.labels.contiguous()},
            path.with_suffix(f".{os.getpid()}.tmp"),
        )
        os.replace(path.with_suffix(f".{os.getpid()}.tmp"), path)
    return path


def tensors(args: argparse.Namespace, pipeline: Pipeline, split: str) -> TensorDataset:
    """The split as float images normalised as the pipeline normalises them, at its input size."""
    record = torch.load(cached_split(args, pipeline.dataset, split), weights_only=True)
    images, labels = record["images"], record["labels"]
    if split == "train" and args.train_limit:
        images, labels = images[: args.train_limit], labels[: args.train_limit]
    x = images.float() / 255.0
    pad = (pipeline.input_size - x.shape[-1]) // 2
    if pad > 0:
        x = F.pad(x, (pad, pad, pad, pad))
    mean, std = (torch.tensor(v).view(1, -1, 1, 1) for v in pipeline.normalize)
    return TensorDataset((x - mean) / std, labels)


# --- one run -----------------------------------------------------------------------------------------------------


def accuracy(model: torch.nn.Module, data: TensorDataset, device: str) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=1000):
            correct += int((model(x.to(device)).argmax(1).cpu() == y).sum())
    model.train()
    return 100.0 * correct / len(data)


def run_one(args: argparse.Namespace, name: str, arm: str, seed: int, progress: Path) -> dict[str, Any]:
    from equiconvert.privacy import BatchMemoryManager, PrivacyEngine

    pipeline = PIPELINES[name]
    torch.manual_seed(seed)
    model, facts = build_arm(pipeline, arm)
    model = model.to(args.device)
    train, test = tensors(args, pipeline, "train"), tensors(args, pipeline, "test")
    optimizer = pipeline.optimizer(model.parameters())
    for group in optimizer.param_groups:
        group["lr"] *= args.lr_scale
    epochs = args.epochs or pipeline.epochs
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(train, batch_size=pipeline.batch_size),
        target_epsilon=pipeline.epsilon,
        target_delta=pipeline.delta,
        max_grad_norm=pipeline.max_grad_norm,
        epochs=epochs,
    )
    checkpoint = checkpoint_path(progress)
    done, curve, spent = 0, [], 0.0
    if checkpoint.exists():  # a run stopped at a deadline: go on from its last finished epoch
        saved = engine.load_checkpoint(path=checkpoint, module=model, optimizer=optimizer)
        done, curve, spent = int(saved["epoch"]), list(saved["curve"]), float(saved["train_s"])
    start, steps = time.perf_counter() - spent, optimizer.steps
    for epoch in range(done, max(1, round(epochs))):
        with BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=pipeline.physical_batch_size, optimizer=optimizer
        ) as batches:
            for x, y in batches:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(model(x.to(args.device)), y.to(args.device)).backward()
                optimizer.step()
        steps = optimizer.steps  # DP steps taken (a physical batch that is not a logical batch's last one steps none)
        if epoch in {round(epochs) // 3 - 1, 2 * round(epochs) // 3 - 1}:
            curve.append({"epoch": epoch + 1, "test_accuracy": accuracy(model, test, args.device)})
        elapsed = round(time.perf_counter() - start, 1)
        record = {"epoch": epoch + 1, "train_s": elapsed, "curve": curve}
        partial = checkpoint.with_suffix(".ckpt-partial")  # a run killed while saving keeps its last whole one
        engine.save_checkpoint(path=partial, module=model, optimizer=optimizer, checkpoint_dict=record)
        os.replace(partial, checkpoint)
        progress.write_text(json.dumps({**record, "steps": steps}))
    return {
        "pipeline": name,
        "arm": arm,
        "seed": seed,
        "test_accuracy": accuracy(model, test, args.device),
        "curve": curve,
        "epsilon": engine.get_epsilon(pipeline.delta),
        "lr": optimizer.param_groups[0]["lr"],
        "steps": steps,
        "epochs": epochs,
        "train_s": round(time.perf_counter() - start, 1),
        **facts,
    }


# --- the gallery ------------------------------------------------------------------------------------------------


def checkpoint_path(progress: Path) -> Path:
    """The run's state after its last finished epoch (model, optimizer, accountant, budget; never the noise's
    generator): DP-trained weights, private as the final ones, deleted once the run's result is written."""
    return progress.with_suffix(".ckpt")


def result_path(args: argparse.Namespace, name: str, arm: str, seed: int) -> Path:
    scale = f"_lr_x{args.lr_scale:g}" if args.lr_scale != 1.0 else ""
    schedule = f"_ep{args.epochs:g}" if args.epochs else ""  # a shortened schedule is another experiment
    return Path(args.out) / "runs" / name / (arm.replace("=", "_as_") + scale + schedule) / f"seed{seed}.json"


def run_all(args: argparse.Namespace) -> None:
    names = [n for n in args.pipelines.split(",") if n]
    unknown = sorted(set(names) - set(PIPELINES))
    if unknown:
        raise SystemExit(f"error: --pipelines: unknown {unknown}; known: {sorted(PIPELINES)}")
    for dataset in {PIPELINES[n].dataset for n in names}:
        for split in ("train", "test"):
            cached_split(args, dataset, split)
    todo = [
        (name, arm, int(seed))
        for seed in args.seeds.split(",")
        for name in names
        for arm in args.arms.split(",")
        if not result_path(args, name, arm, int(seed)).exists()
    ]
    start, running = time.monotonic(), []
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    while todo or running:
        late = args.deadline_s and time.monotonic() - start > args.deadline_s
        running = [(p, job) for p, job in running if p.poll() is None or _reap(p, job)]
        if late:
            for process, job in running:
                process.kill()
                print(f"deadline: stopped {job}", file=sys.stderr)
            break
        while todo and len(running) < args.jobs:
            job = todo.pop(0)
            command = [sys.executable, __file__, *sys.argv[1:], "--worker", job[0], job[1], str(job[2])]
            log = open(logs / f"{job[0]}-{job[1].replace('=', '_as_')}-{job[2]}.log", "w")
            running.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), job))
        time.sleep(1.0)
    write_summary(args)


def _reap(process: subprocess.Popen, job: tuple) -> bool:
    if process.returncode:
        print(f"failed ({process.returncode}): {job}", file=sys.stderr)
    return False


def write_summary(args: argparse.Namespace) -> None:
    results = [json.loads(p.read_text()) for p in sorted((Path(args.out) / "runs").glob("*/*/seed*.json"))]
    arms: dict[str, dict[str, Any]] = {}
    for r in results:
        key = f"{r['pipeline']}/{r['arm']}/{r.get('lr')}/{r['epochs']}"
        entry = arms.setdefault(
            key, {"pipeline": r["pipeline"], "arm": r["arm"], "lr": r.get("lr"), "epochs": r["epochs"], "runs": []}
        )
        entry["runs"].append({k: r[k] for k in ("seed", "test_accuracy", "epsilon", "train_s")})
        entry["params"] = r["params"]
        entry["params_original"] = r["params_original"]
    for entry in arms.values():
        entry["median_accuracy"] = statistics.median(run["test_accuracy"] for run in entry["runs"])
    progress = {
        str(p.relative_to(Path(args.out) / "runs")): json.loads(p.read_text())
        for p in sorted((Path(args.out) / "runs").glob("*/*/seed*.progress"))
    }
    summary = {
        "command": "python benchmarks/pipelines.py " + " ".join(a for a in sys.argv[1:] if a),
        "date": time.strftime("%Y-%m-%d"),
        "card": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "CPU",
        "torch": torch.__version__,
        "arms": sorted(arms.values(), key=lambda e: (e["pipeline"], e["arm"])),
        "results": results,
        "progress": progress,
    }
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        name, arm, seed = args.worker
        path = result_path(args, name, arm, int(seed))
        path.parent.mkdir(parents=True, exist_ok=True)
        result = run_one(args, name, arm, int(seed), path.with_suffix(".progress"))
        path.write_text(json.dumps(result, indent=1))
        checkpoint_path(path.with_suffix(".progress")).unlink(missing_ok=True)
        print(json.dumps({k: result[k] for k in ("pipeline", "arm", "seed", "test_accuracy", "params", "train_s")}))
        return
    run_all(args)


if __name__ == "__main__":
    main()
