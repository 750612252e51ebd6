"""Equivalence with the paper's released code (hlzl/equivariant), proven on CPU on the same inputs.

Compares, and writes as one JSON summary:
  model     the released EquivariantResNet9 (its CIFAR-10 D4 configuration) against our preset with the released
            code's options, with the released weights mapped onto ours through their dense filters: logits and each
            stage's activations, the mapping's residual per layer, parameter counts per layer;
  dp_step   one DP step with the noise off: our trainer against a naive per-example loop of our formula, and of the
            released formula (sum of view gradients clipped at C, divided by its batch) on our model; with the
            checkout, the released step run on the released model against ours on the mapped model;
  escnn     (in model) the released function, weight standardization on, against ours standardizing in escnn's
            coordinates (standardization_coordinates="escnn") with the released raw coefficients mapped onto ours;
  settings  everything around the step, read from the released code's configuration and source (value and
            file:line) and from ours (the paper preset and the released-settings recipe).

The released code is the user's checkout (--released DIR or EQUICONVERT_RELEASED_CODE); nothing of it is copied
here. It is imported at run time with shims for what its model does not need on CPU (scikit-image, einops' two
reshapes, its hard-coded CUDA device). Building its model takes about two minutes on a 2-core CPU (escnn's basis
solver); everything else runs in seconds.

Usage: python benchmarks/fidelity.py --released DIR [--out JSON] [--doc docs/fidelity.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # the package and the sibling modules, also when loaded by path
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from fidelity_model import compare_models, our_parameter_counts  # noqa: E402
from fidelity_settings import PRESET, RELEASED_RECIPE, settings_rows  # noqa: E402
from fidelity_step import dp_step_ours, dp_step_released  # noqa: E402
from released_code import ENV_VAR, RELEASED_REPO, released_commit, released_dir  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "summaries" / "fidelity.json"
TABLE_BEGIN, TABLE_END = "<!-- fidelity-table:begin -->", "<!-- fidelity-table:end -->"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.10g}"
    if isinstance(value, list):
        return (
            ", ".join(_cell(v) for v in value)
            if not any(isinstance(v, list) for v in value)
            else "; ".join(f"({_cell(v)})" for v in value)
        )
    return str(value).replace("|", "\\|")


def render_table(summary: dict[str, Any]) -> str:
    """The Markdown table of every setting in which the released code and ours differ, as docs/fidelity.md shows
    it."""
    lines = [
        "| aspect | released (file:line) | ours, paper preset (where) | ours, released recipe | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in summary["settings"]:
        if row.get("equal", True) and row.get("equal_in_released_recipe", True):
            continue
        rel = row["released"]
        mine = row["ours"]
        theirs = row["ours_released_recipe"]["value"]
        if row["equal_in_released_recipe"]:
            recipe = "same"
        else:
            recipe = "differs (as the preset)" if theirs == mine["value"] else "differs: " + _cell(theirs)
        lines.append(
            f"| {row['aspect']} | {_cell(rel['value'])} (`{rel['where']}`) | {_cell(mine['value'])} "
            f"(`{mine['where']}`) | {recipe} | {_cell(row['note'])} |"
        )
    return "\n".join(lines) + "\n"


def check_rows(summary: dict[str, Any]) -> list[dict[str, str]]:
    """The results page's rows: one line per comparison."""
    step = summary["dp_step_ours"]
    rows = [
        {
            "check": "one DP step, noise off: our trainer against a per-example loop",
            "result": f"update: relative difference {step['update_relative_difference']:.1e}",
        }
    ]
    if "model" not in summary:
        return rows
    model, left = summary["model"], summary["differences_left_by_released_recipe"]
    counts_equal = all(layer["released_params"] == layer["our_params"] for layer in model["layers"])
    escnn = model["escnn_coordinates"]
    return [
        {
            "check": "model function: the released model against ours with its weights mapped",
            "result": f"logits: relative difference {model['logits_relative_difference']:.1e}",
        },
        {
            "check": "model function, weight standardization on: the released model against ours standardizing in "
            "escnn's coordinates",
            "result": f"logits: max difference {escnn['logits_max_abs_difference']:.1e}; "
            f"{escnn['released_coordinates']['logits_max_abs_difference']:.1e} in its escnn fork's coordinates "
            "(conv4's are not per field pair), "
            f"{escnn['released_coordinates_conv4_given_the_released_filter']['logits_max_abs_difference']:.1e} "
            "with conv4's filter given",
        },
        {
            "check": "parameters per layer",
            "result": f"{model['released_params']:,} against {model['our_params']:,}; "
            + ("every layer equal" if counts_equal else "layers differ"),
        },
        *rows,
        {
            "check": "settings around the step",
            "result": f"{len(summary['settings'])} compared: {len(summary['differences'])} differ from the paper "
            f"preset, {len(left)} from the released-settings recipe ({', '.join(left)})",
        },
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--released", help=f"checkout of {RELEASED_REPO} (default: ${ENV_VAR})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON summary")
    parser.add_argument("--doc", type=Path, help="also rewrite the difference table of this page (docs/fidelity.md)")
    parser.add_argument("--ours-only", action="store_true", help="without the released code: our side only")
    parser.add_argument("--batch", type=int, default=4, help="inputs for the model comparison")
    args = parser.parse_args(argv)
    root = None if args.ours_only else released_dir(args.released)
    summary: dict[str, Any] = {
        "kind": "fidelity",
        "order": 3,
        "title": "Equivalence with the paper's released code",
        "description": "The paper's released code (hlzl/equivariant), its CIFAR-10 D4 configuration, against our "
        "preset with its settings, on the same inputs on the CPU: the model with the released weights mapped onto "
        "ours, one DP step with the noise off, and every setting around the step read from both codes.",
        "card": "2-core CPU, no GPU",
        "command": "python benchmarks/fidelity.py --released DIR" + (" --ours-only" if root is None else ""),
        "date": datetime.now(timezone.utc).date().isoformat(),
        "released": None if root is None else {"repository": RELEASED_REPO, "commit": released_commit(root)},
        "recipes": {"ours": PRESET, "ours_released_recipe": RELEASED_RECIPE},
        "dp_step_ours": dp_step_ours(),
    }
    if root is None:
        summary["our_parameter_counts"] = our_parameter_counts()
    else:
        model, released, ours = compare_models(root, args.batch)
        summary["model"] = model
        summary["dp_step_released"] = dp_step_released(root, released, ours)
    summary["settings"] = settings_rows(root)
    if root is not None:
        summary["differences"] = [r["aspect"] for r in summary["settings"] if not r["equal"]]
        summary["differences_left_by_released_recipe"] = [
            r["aspect"] for r in summary["settings"] if not r["equal_in_released_recipe"]
        ]
    summary["rows"] = check_rows(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    if args.doc is not None:
        write_table(args.doc, render_table(summary))
    print(f"wrote {args.out}")
    return summary


def write_table(doc: Path, table: str) -> None:
    """Replace the table between the page's markers."""
    text = doc.read_text()
    begin, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    doc.write_text(text[:begin] + "\n" + table + text[end:])


if __name__ == "__main__":
    main()
