"""A physical batch's clipped sum replayed as one CUDA graph (DPConfig.cuda_graph).

On a small model the DP step launches about 1,700 operators per physical batch, and its wall time exceeds its
kernels' time by the host's work (docs/guides/performance.md). Every physical batch of one shape runs the same
kernels, so that computation (forward, backward, per-example gradients, clipping and their sum) is captured once
and replayed: the batch is copied into the graph's input tensors and the results are the graph's output tensors,
which the caller reads before the next batch. A batch of another shape (a step's last, unpadded one) runs
eagerly. The capture follows torch.cuda.graphs' recipe for a whole network: warm-up calls on a side stream (the
back-end's probe, the filter-gradient kernels' timing, cuDNN's and Triton's tuning all happen there), then one
capture. Off CUDA the same path runs with each replay a plain call, so its bookkeeping is tested on any machine.

Privacy: a replay computes exactly what the eager call computes (the same kernels on the same tensors); the
noise is drawn outside the graph, once per logical step, from the secret source. The input tensors hold the last
physical batch on the device, as the eager step's activations do; nothing is written anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ..errors import UsageError

WARMUP_CALLS = 3  # torch.cuda.graphs' recipe warms up on a side stream before capturing
GRAPH_DEVICES = ("cuda",)  # device types whose batches are captured; elsewhere a replay is a plain call


class GraphCaptureError(UsageError, RuntimeError):
    """The physical batch's computation could not be captured as a CUDA graph; the message says what to do."""


class ChunkResult(NamedTuple):
    """One physical batch's results: per-example losses (B,), how many examples had a non-finite gradient (a
    device tensor), and the clipped sum of their gradients by parameter name."""

    losses: torch.Tensor
    nonfinite: torch.Tensor
    clipped: dict[str, torch.Tensor]


ChunkFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], ChunkResult]  # (views, labels, real rows)
Signature = tuple[tuple[int, ...], torch.dtype, tuple[int, ...], bool]


def _signature(views: torch.Tensor, labels: torch.Tensor, real: torch.Tensor | None) -> Signature:
    return tuple(views.shape), views.dtype, tuple(labels.shape), real is None


class GraphedChunks:
    """Calls `compute` on physical batches, replaying one captured graph for every batch of `rows` examples.

    The first batch of that size is captured (after WARMUP_CALLS warm-up calls on it); from then on such a
    batch is copied into the graph's inputs and replayed. The result returned for it is the graph's output
    tensors, overwritten by the next replay: use them (queue the kernels that read them) before the next call.
    """

    def __init__(self, compute: ChunkFn, rows: int, warmup_calls: int = WARMUP_CALLS) -> None:
        self._compute = compute
        self._rows = rows
        self._warmup_calls = warmup_calls
        self._signature: Signature | None = None
        self._inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self._outputs: ChunkResult | None = None
        self._replay: Callable[[], None] = lambda: None

    @property
    def captured(self) -> bool:
        """Whether a batch has been captured (its replays serve every later batch of its shape)."""
        return self._signature is not None

    def __call__(self, views: torch.Tensor, labels: torch.Tensor, real: torch.Tensor | None) -> ChunkResult:
        signature = _signature(views, labels, real)
        if self._signature is None and views.shape[0] == self._rows:
            self._capture(views, labels, real)
            self._signature = signature
        if signature != self._signature:
            return self._compute(views, labels, real)
        assert self._inputs is not None
        for static, value in zip(self._inputs, (views, labels, real)):
            if static is not None:
                static.copy_(value)
        self._replay()
        assert self._outputs is not None
        return self._outputs

    def _capture(self, views: torch.Tensor, labels: torch.Tensor, real: torch.Tensor | None) -> None:
        """Fix the input tensors, warm up on them and capture one call (on CUDA; elsewhere a replay is a call)."""
        self._inputs = (views.clone(), labels.clone(), None if real is None else real.clone())
        if views.device.type not in GRAPH_DEVICES:  # the first replay computes the output tensors
            self._replay = self._call_into_outputs
            return
        device = views.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(self._warmup_calls):
                self._compute(*self._inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._outputs = self._compute(*self._inputs)
        except RuntimeError as error:  # what ran eagerly in the warm-up but not under capture
            raise GraphCaptureError(
                f"dp.cuda_graph: the computation of a physical batch of {self._rows} examples ran eagerly but could "
                f"not be captured as a CUDA graph ({error}). A model whose forward waits for the host (.item(), "
                ".cpu(), shapes that depend on values) cannot be captured: train it with dp.cuda_graph=false"
            ) from error
        self._replay = graph.replay

    def _call_into_outputs(self) -> None:
        """Off CUDA: one call on the input tensors, its results copied into the output tensors (what a replay
        does to them); the first call's results become those tensors."""
        assert self._inputs is not None
        result = self._compute(*self._inputs)
        if self._outputs is None:
            self._outputs = result
            return
        self._outputs.losses.copy_(result.losses)
        self._outputs.nonfinite.copy_(result.nonfinite)
        for name, value in result.clipped.items():
            self._outputs.clipped[name].copy_(value)
