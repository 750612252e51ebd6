"""What a pipeline's learning rate and clip meet at initialisation: the original's network against its conversions.

For each gallery pipeline (benchmarks/pipeline_gallery/) and arm, over --seeds draws of the network: the std of the
logits and the initial cross-entropy on --examples test images (fed as the pipeline feeds them), and each of those
examples' gradient norm (one backward per example), with the share of examples the pipeline's clip cuts. A
conversion keeps the pipeline's hyper-parameters meaningful when its logit std and median per-example gradient
norm stay within a small factor of the original's: the clip then cuts a similar share and the step (lr x clipped
gradient) moves the logits by a similar amount. CPU is enough.

    python benchmarks/pipeline_init_scale.py --data-dir DIR --out OUT \
        --pipelines opacus_cifar10,tramer_boneh_cifar10 --arms original,default,dp --seeds 0,1,2

Writes OUT/pipeline_init_scale.json (a results-page summary, kind pipeline_init_scale); the decoded images are
cached in OUT/data/ as benchmarks/pipelines.py caches them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
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

import pipelines  # noqa: E402
from pipeline_gallery import PIPELINES  # noqa: E402
from pipeline_gallery.arms import ORIGINAL, build_arm  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="folder holding cifar10/ and fashion-mnist/")
    parser.add_argument("--out", required=True)
    parser.add_argument("--pipelines", default="opacus_cifar10,tramer_boneh_cifar10")
    parser.add_argument("--arms", default="original,default,dp")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--examples", type=int, default=32, help="test images per draw")
    parser.add_argument("--train-limit", type=int, default=0, help=argparse.SUPPRESS)  # pipelines.tensors reads it
    return parser.parse_args(argv)


def measure(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, clip: float) -> dict[str, float]:
    """Logit std, initial loss, median per-example gradient norm and the share of examples above `clip`."""
    model.train()  # as the DP step sees it (GroupNorm and the converted norms do not depend on the batch)
    with torch.no_grad():
        logits = model(images)
    norms = []
    for x, y in zip(images, labels):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[None]), y[None]).backward()
        squares = [p.grad.pow(2).sum() for p in model.parameters() if p.grad is not None]
        norms.append(torch.stack(squares).sum().sqrt().item())
    return {
        "logit_std": round(logits.std().item(), 4),
        "loss": round(F.cross_entropy(logits, labels).item(), 4),
        "grad_norm_median": round(statistics.median(norms), 4),
        "clipped_share": round(sum(n > clip for n in norms) / len(norms), 3),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name in [n for n in args.pipelines.split(",") if n]:
        if name not in PIPELINES:
            raise SystemExit(f"error: --pipelines: unknown {name!r}; known: {sorted(PIPELINES)}")
        pipeline = PIPELINES[name]
        test = pipelines.tensors(args, pipeline, "test")
        images, labels = test.tensors[0][: args.examples], test.tensors[1][: args.examples]
        for arm in [a for a in args.arms.split(",") if a]:
            draws = []
            for seed in [int(s) for s in args.seeds.split(",")]:
                torch.manual_seed(seed)
                model, facts = build_arm(pipeline, arm)
                draws.append(measure(model, images, labels, pipeline.max_grad_norm))
            rows.append({"pipeline": name, "arm": arm, "params": facts["params"], "clip": pipeline.max_grad_norm,
                         "draws": draws})  # fmt: skip
    for row in rows:  # each measure as a multiple of the original's (medians over draws)
        original = next((r for r in rows if r["pipeline"] == row["pipeline"] and r["arm"] == ORIGINAL), None)
        for key in ("logit_std", "grad_norm_median"):
            mine = statistics.median(d[key] for d in row["draws"])
            row[f"{key}_vs_original"] = (
                round(mine / statistics.median(d[key] for d in original["draws"]), 3) if original else None
            )
    return {
        "kind": "pipeline_init_scale",
        "order": 2.1,
        "title": "Gallery pipelines at initialisation: what their learning rate and clip meet, original and converted",
        "description": (
            f"For each pipeline and arm, {len(args.seeds.split(','))} draws of the network (seeds {args.seeds}) on "
            f"the first {args.examples} test images, fed as the pipeline feeds them: the logit std, the initial "
            "cross-entropy, the median per-example gradient norm (one backward per example, training mode) and the "
            "share of examples the pipeline's clip cuts; the last two columns divide the medians over draws by the "
            "original's."
        ),
        "command": "python benchmarks/pipeline_init_scale.py " + " ".join(sys.argv[1:]),
        "card": platform.processor() or "CPU",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    summary = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline_init_scale.json").write_text(json.dumps(summary, indent=1))
    for row in summary["rows"]:
        print(row["pipeline"], row["arm"], row["params"], row["logit_std_vs_original"], row["grad_norm_median_vs_original"],
              [(d["logit_std"], d["grad_norm_median"], d["clipped_share"]) for d in row["draws"]])  # fmt: skip


if __name__ == "__main__":
    main()
