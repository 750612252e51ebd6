"""The argument list of a tiny `equiconvert train` run, for the tests that train through the command line."""

from __future__ import annotations

from pathlib import Path

# One step on the synthetic data set, batch 8, one view per example, on the CPU: seconds on a loaded CPU.
TINY_FLAGS: dict[str, str] = {
    "--dataset": "synthetic",
    "--steps": "1",
    "--batch-size": "8",
    "--aug-mult": "1",
    "--physical-batch-size": "8",
    "--device": "cpu",
}


def tiny_train_args(out: Path, *extra: str, **overrides: str | float | None) -> list[str]:
    """`train` as TINY_FLAGS say, writing to `out`, without a progress bar.

    A keyword sets its flag (model_kwargs="widths=4,8,8": --model-kwargs widths=4,8,8), replacing the tiny value;
    None drops the flag. `extra` (switches, --set KEY=VALUE) comes last, as given.
    """
    flags: dict[str, str | float | None] = {**TINY_FLAGS, "--out": str(out)}
    flags.update({"--" + name.replace("_", "-"): value for name, value in overrides.items()})
    pairs = [[flag, str(value)] for flag, value in flags.items() if value is not None]
    return ["train", *(word for pair in pairs for word in pair), "--set", "run.progress=false", *extra]
