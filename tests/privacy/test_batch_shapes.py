"""A module that mixes examples only at batch sizes the first probe did not run is refused at the first batch of
such a size, by both front-ends; the per-example-isolated path (vmap) keeps examples apart whatever the module."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from equiconvert.privacy.backends import backend_for
from equiconvert.privacy.validate import PrivacyValidationError
from tests.privacy.test_buffer_leaks import _data, _make_private, _model, _one_private_step, _trainer


class MixesAtSizes(nn.Module):
    """Adds the batch mean to every example, but only in batches whose size `mixes(rows)` picks."""

    def __init__(self, mixes) -> None:
        super().__init__()
        self.mixes = mixes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.mean(0, keepdim=True) if self.mixes(x.shape[0]) else x


def test_a_module_mixing_only_in_the_last_smaller_chunk_is_refused_by_the_trainer():
    # the probe runs at 4 rows (the full chunks), book-keeping's own check at 3
    model = _model(MixesAtSizes(lambda rows: rows == 2))
    trainer = _trainer(model, batch_size=10, physical_batch_size=4, steps=30)
    with pytest.raises(PrivacyValidationError, match=r"module '2' mixes examples: in a batch of 2,"):
        trainer.fit(_data(16))
    assert trainer.per_sample_method == "bookkeeping" and trainer.step < 30


def test_a_module_mixing_only_in_poisson_batches_above_the_loader_batch_is_refused_by_make_private():
    model = _model(MixesAtSizes(lambda rows: rows > 4))  # the loader's batch is 4: the probe runs at 4
    images, labels = _data(16)
    private, optimizer, loader = _make_private(model, images, labels)
    sizes = []
    with pytest.raises(PrivacyValidationError, match=r"module '2' mixes examples: in a batch of ([5-9]|1\d),"):
        for batch, targets in itertools.islice(loader, 30):
            sizes.append(len(batch))
            _one_private_step(private, optimizer, batch, targets)
    assert sizes[-1] > 4 and all(size <= 4 for size in sizes[:-1])  # refused at the first larger batch


def test_the_isolated_path_keeps_examples_apart_from_a_mixer_the_probes_missed():
    """vmap runs each example's forward on its own: a module that mixes whatever it is given (as an evasive one
    does once past the probes) sees one example's views only, so example 0's gradient ignores the others; the
    batched back-end (book-keeping) under the same module does not."""
    model = _model(MixesAtSizes(lambda rows: True)).double()
    generator = torch.Generator().manual_seed(0)
    views = torch.randn(4, 2, 2, 6, 6, generator=generator, dtype=torch.float64)  # 4 examples, 2 views each
    others = views.clone()
    others[1:] = torch.randn(others[1:].shape, generator=generator, dtype=torch.float64)
    labels = torch.arange(4) % 4

    def example0(method: str, batch: torch.Tensor) -> torch.Tensor:
        params = {n: p.detach() for n, p in model.named_parameters()}
        grads, _ = backend_for(method, "fp32").compute(model, params, {}, batch, labels, _losses)
        return torch.cat([g[0].flatten() for g in grads.values()])

    assert torch.allclose(example0("vmap", views), example0("vmap", others), rtol=0, atol=1e-12)
    assert not torch.allclose(example0("bookkeeping", views), example0("bookkeeping", others), atol=1e-6)


def _losses(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction=reduction)
