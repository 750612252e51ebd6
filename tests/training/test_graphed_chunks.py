"""cuda_graph: physical batches of the captured size reuse one set of input and output tensors and compute what the
eager step computes; other sizes run eagerly. Off CUDA a replay is a plain call (the CUDA capture itself is checked
by benchmarks/dp_engines.py's noise-free check of `dptrainer_graph` on a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from equiconvert.training.dp_config import DPConfig
from equiconvert.training.graphed_chunks import ChunkResult, GraphedChunks
from equiconvert.training.trainer import DPTrainer
from equiconvert.training.trainer_checkpoint import METHOD_ONLY_OPTIONS


def _weighted_sums(calls: list[int]):
    """A stand-in clipped sum: losses = views summed per row, clipped = {"w": that times the labels}."""

    def compute(views: torch.Tensor, labels: torch.Tensor, real: torch.Tensor | None) -> ChunkResult:
        calls.append(views.shape[0])
        losses = views.flatten(1).sum(1)
        kept = losses if real is None else torch.where(real, losses, 0.0)
        return ChunkResult(losses, (~torch.isfinite(losses)).sum(), {"w": (kept * labels).sum().reshape(1)})

    return compute


def test_batches_of_the_captured_size_reuse_its_tensors_and_get_their_own_results():
    calls: list[int] = []
    graphed = GraphedChunks(_weighted_sums(calls), rows=4)
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randn(4, 2, 3, generator=generator) for _ in range(2))
    labels = torch.tensor([1.0, 2.0, 3.0, 4.0])
    result = graphed(first, labels, None)
    assert graphed.captured and calls == [4]  # off CUDA the capture computes the batch once
    torch.testing.assert_close(result.losses, first.flatten(1).sum(1))
    kept = {name: value.clone() for name, value in result.clipped.items()}
    again = graphed(second, labels, None)
    assert again.losses is result.losses and again.clipped["w"] is result.clipped["w"]  # the same output tensors
    torch.testing.assert_close(again.losses, second.flatten(1).sum(1))
    torch.testing.assert_close(again.clipped["w"], (second.flatten(1).sum(1) * labels).sum().reshape(1))
    assert not torch.equal(kept["w"], again.clipped["w"])  # the second batch's own sum, not the first's


def test_other_sizes_and_padding_masks_run_eagerly_and_do_not_capture():
    calls: list[int] = []
    graphed = GraphedChunks(_weighted_sums(calls), rows=4)
    small = graphed(torch.ones(3, 2), torch.ones(3), None)  # a step's last, unpadded physical batch
    assert not graphed.captured and calls == [3] and small.losses.tolist() == [2.0, 2.0, 2.0]
    real = torch.tensor([True, True, False, False])
    padded = graphed(torch.ones(4, 2), torch.ones(4), real)
    assert graphed.captured and padded.clipped["w"].item() == 4.0  # blank rows add nothing
    unpadded = graphed(torch.ones(4, 2), torch.ones(4), None)  # no mask: another signature, eager
    assert unpadded.clipped["w"].item() == 8.0 and unpadded.losses is not padded.losses


class _FakeStream:
    def wait_stream(self, other: object) -> None:
        pass


def test_a_batch_that_runs_eagerly_but_fails_under_capture_names_the_flag_and_the_remedy(monkeypatch):
    """The CUDA capture path, with torch.cuda's streams and graphs replaced by stand-ins on the CPU: the warm-up calls
    run, and an error raised under capture (a host synchronisation, say) becomes GraphCaptureError naming
    dp.cuda_graph and what to do."""
    import contextlib

    from equiconvert.errors import UsageError
    from equiconvert.training import graphed_chunks

    capturing = []
    calls: list[int] = []
    eager = _weighted_sums(calls)

    def compute(views, labels, real):
        if capturing:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return eager(views, labels, real)

    @contextlib.contextmanager
    def graph(cuda_graph):
        capturing.append(True)
        yield

    monkeypatch.setattr(graphed_chunks, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    graphed = GraphedChunks(compute, rows=4)
    with pytest.raises(graphed_chunks.GraphCaptureError, match=r"dp\.cuda_graph.*dp\.cuda_graph=false") as caught:
        graphed(torch.ones(4, 2), torch.ones(4), None)
    assert isinstance(caught.value, UsageError) and "not permitted when stream is capturing" in str(caught.value)
    assert calls == [4, 4, 4]  # the warm-up calls ran eagerly before the capture


def _trained(cuda_graph: bool, physical_batch_multiple: int, method: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)
    )
    trainer = DPTrainer(
        model,
        device="cpu",
        progress=False,
        per_sample_method=method,
        batch_size=21,
        physical_batch_size=8,
        physical_batch_multiple=physical_batch_multiple,
        aug_mult=2,
        noise_multiplier=1.0,
        max_grad_norm=0.05,
        normalize_mean=0.0,
        steps=3,
        ema_decay=None,
        insecure_seeded_noise=True,  # both runs draw the same samples and the same noise
        cuda_graph=cuda_graph,
    )
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (64, 3, 8, 8), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 3, (64,), generator=generator)
    trainer._prepare_privacy(len(labels))
    for _ in range(3):
        trainer.train_step(images, labels)
    assert (trainer._graphed is not None) == cuda_graph
    if cuda_graph:
        assert trainer._graphed.captured  # full physical batches went through the captured path
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("method", ["bookkeeping", "ghost"])
@pytest.mark.parametrize("physical_batch_multiple", [1, 8])
def test_training_with_cuda_graph_gives_the_eager_steps_weights(method, physical_batch_multiple):
    eager = _trained(False, physical_batch_multiple, method)
    graphed = _trained(True, physical_batch_multiple, method)
    assert eager.keys() == graphed.keys()
    for name in eager:
        torch.testing.assert_close(graphed[name], eager[name], rtol=1e-6, atol=1e-7)


def test_cuda_graph_is_off_by_default_and_a_resumed_run_may_change_it():
    assert DPConfig().cuda_graph is False
    assert "cuda_graph" in METHOD_ONLY_OPTIONS  # how the step is executed, not what it computes
