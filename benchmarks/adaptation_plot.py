"""The results page's figure for the pretrained-adaptation summary: accuracy vs epsilon per model, upright and turned."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(summary: dict[str, Any], path: Path) -> None:
    """One panel per task; per model the median over seeds on upright (solid) and turned (dashed) test images."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.0), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, task in zip(axes[0], tasks):
        for i, model in enumerate(dict.fromkeys(r["model"] for r in rows)):
            mine = sorted((r for r in rows if r["task"] == task and r["model"] == model), key=lambda r: r["epsilon"])
            epsilons = [r["epsilon"] for r in mine]
            color = colors[i % len(colors)]
            ax.plot(epsilons, [r["upright"] for r in mine], marker="o", color=color, label=f"{model}: upright")
            ax.plot(
                epsilons, [r["turned"] for r in mine], marker="x", linestyle="--", color=color, label=f"{model}: turned"
            )
        ax.set_xscale("log")
        ticks = sorted({r["epsilon"] for r in rows if r["task"] == task})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("epsilon")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(task)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(summary["figure"]["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
