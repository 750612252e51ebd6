"""The guides' Python blocks run as written, without tripping the library's own warnings.

A block that continues the reader's own pipeline gets it from READERS (small stand-ins for the names it takes); a
block that cannot run here is listed in NOT_RUN with the reason, and the list must match the guides exactly, so a
new or changed block cannot be skipped silently.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.support.paths import REPO_ROOT
from tests.support.snippets import library_warnings, python_blocks

GUIDES = sorted((REPO_ROOT / "docs" / "guides").glob("*.md")) + [REPO_ROOT / "docs" / "make-private.md"]
BLOCKS = {f"{path.relative_to(REPO_ROOT)}#{i}": block for path in GUIDES for i, block in enumerate(python_blocks(path))}

# blocks that do not run here, and why (each must still be a block of the guides)
NOT_RUN = {
    "docs/guides/adapting-pretrained.md#0": "downloads torchvision's ImageNet weights (no network here)",
    "docs/guides/adapting-pretrained.md#1": "a fragment: `...` stands for the reader's DPTrainer settings",
    "docs/guides/adapting-pretrained.md#2": "the reader's pretrained network and public and private data sets",
    "docs/guides/adapting-pretrained.md#3": "continues #2 with the reader's pretrained network",
    "docs/guides/converting-your-dp-pipeline.md#0": "one line converting the reader's model, in the text's context",
    "docs/guides/private-training.md#0": "the paper's GPU run: batch 8192 x 4 views for 2200 steps",
    "docs/make-private.md#3": "one line of a loop over aug_mult views, with names from the text around it",
}
# blocks that continue the reader's pipeline: the block ids, in order, sharing one namespace
CONTINUED = [["docs/make-private.md#0"], ["docs/make-private.md#1", "docs/make-private.md#2"]]


def readers_pipeline() -> dict:
    """The reader's model, optimizer and training loader, small."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)
    )
    data = TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 10, (64,)))
    return {
        "F": F,
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "train_loader": DataLoader(data, batch_size=16),
    }


RUNS = [[key] for key in BLOCKS if key not in NOT_RUN and all(key not in group for group in CONTINUED)] + CONTINUED


def test_every_guide_block_is_run_or_listed_with_its_reason():
    assert set(NOT_RUN) <= set(BLOCKS)
    assert sorted(key for run in RUNS for key in run) == sorted(set(BLOCKS) - set(NOT_RUN))


@pytest.mark.parametrize("keys", RUNS, ids=lambda keys: "+".join(keys))
def test_guide_block_runs_without_library_warnings(keys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = readers_pipeline() if any(key in group for group in CONTINUED for key in keys) else {}
    with library_warnings() as issued:
        for key in keys:
            exec(compile(BLOCKS[key], key, "exec"), namespace)  # noqa: S102 - the guide's own code
    assert issued == []
