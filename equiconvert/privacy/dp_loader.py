"""The user's DataLoader, Poisson-sampled; and physical batches of its logical batches.

`DPDataLoader` keeps the user's dataset, collate function and worker settings and
replaces the batching: each batch takes every example independently with
probability q = 1 / len(original loader) (secret randomness, secure_rng.py), for
len(original loader) batches per epoch, as Opacus' DPDataLoader does and as the
accountants assume. A batch may be empty; it then has the shape of one example's
collated batch with 0 rows, so the training step still runs (and is accounted).

It is an Opacus `DPDataLoader` (a subclass), so that scripts and libraries testing for one (Opacus' Lightning
example, `isinstance(loader, DPDataLoader)`) see the Poisson loader they expect; `DPDataLoader.from_data_loader`
makes one from a plain loader with secret sampling.

`BatchMemoryManager` cuts each logical batch into physical batches of at most
`max_physical_batch_size` examples and tells the DP optimizer to accumulate until
the last one, so one optimizer step (one noise draw) is taken per logical batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from opacus.data_loader import DPDataLoader as OpacusDPDataLoader
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data.dataloader import default_collate

from ..errors import ParameterError, ParameterTypeError
from .opacus_parity import check_opacus_arguments
from .secure_rng import SAMPLING, RandomSource, make_source


class PoissonBatchSampler(Sampler[list[int]]):
    """`steps` batches, each example in each independently with probability `sample_rate`."""

    def __init__(self, num_examples: int, sample_rate: float, steps: int, source: RandomSource) -> None:
        if num_examples <= 0:
            raise ParameterError(f"num_examples={num_examples}: Poisson sampling needs a non-empty dataset")
        if not 0.0 < sample_rate <= 1.0:
            raise ParameterError(f"sample_rate must lie in (0, 1], got {sample_rate}")
        self.num_examples, self.sample_rate, self.steps = num_examples, sample_rate, steps
        self._source = source
        self.drawn = 0  # batches drawn so far: a step on a batch not drawn here is refused (lightning_guard.py)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            self.drawn += 1
            yield self._source.bernoulli_mask(self.num_examples, self.sample_rate).nonzero().flatten().tolist()


def _empty_rows(batch: Any) -> Any:
    """`batch` with every tensor cut to 0 rows (same nesting, dtypes and trailing shapes)."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_empty_rows(b) for b in batch)
    if isinstance(batch, dict):
        return {key: _empty_rows(value) for key, value in batch.items()}
    raise ParameterTypeError(
        f"data_loader: cannot form an empty batch of {type(batch).__name__}; collate batches into tensors"
    )


class _CollateWithEmpty:
    """The user's collate function; an empty sample list becomes a 0-row batch shaped like example 0's."""

    def __init__(self, collate: Callable[[list], Any], dataset: Dataset) -> None:
        self.collate, self.dataset = collate, dataset

    def __call__(self, samples: list) -> Any:
        if samples:
            return self.collate(samples)
        return _empty_rows(self.collate([self.dataset[0]]))


class DPDataLoader(OpacusDPDataLoader):
    """A DataLoader drawing Poisson batches from `data_loader`'s dataset (see the module docstring)."""

    distributed = False  # Opacus' attribute: one process's Poisson sampler (DDP: training.distributed)

    def __init__(self, data_loader: DataLoader, source: RandomSource) -> None:
        dataset = data_loader.dataset
        if isinstance(dataset, IterableDataset):
            raise ParameterTypeError(
                "data_loader: make_private needs a map-style dataset (len() and indexing) for Poisson sampling; "
                f"the data loader's dataset is an IterableDataset ({type(dataset).__name__})"
            )
        steps = len(data_loader)
        self.sample_rate = 1.0 / steps
        self.expected_batch_size = len(dataset) * self.sample_rate
        workers = {"prefetch_factor": data_loader.prefetch_factor} if data_loader.num_workers > 0 else {}
        DataLoader.__init__(  # not Opacus' __init__: its sampler draws from a seedable generator
            self,
            dataset,
            batch_sampler=PoissonBatchSampler(len(dataset), self.sample_rate, steps, source),
            num_workers=data_loader.num_workers,
            collate_fn=_CollateWithEmpty(data_loader.collate_fn or default_collate, dataset),
            pin_memory=data_loader.pin_memory,
            timeout=data_loader.timeout,
            worker_init_fn=data_loader.worker_init_fn,
            multiprocessing_context=data_loader.multiprocessing_context,
            persistent_workers=data_loader.persistent_workers,
            **workers,
        )

    @classmethod
    def from_data_loader(
        cls,
        data_loader: DataLoader,
        *,
        distributed: bool = False,
        generator: torch.Generator | None = None,
        batch_first: bool = True,
        rand_on_empty: bool = False,
    ) -> DPDataLoader:
        """Opacus' constructor: a Poisson loader over `data_loader`'s dataset, sampled from secret randomness."""
        if distributed:
            raise ParameterError(
                "DPDataLoader.from_data_loader(distributed=True) is not supported: each process would sample on its "
                "own; train on several GPUs with DPTrainer (training.distributed) or one process per loader"
            )
        if generator is not None:
            raise ParameterError(
                "DPDataLoader.from_data_loader(generator=...) is not supported: a given generator makes the sampling "
                "seedable, and whoever knows its seed knows which examples each batch holds; leave it out (the "
                "batches are drawn from secret randomness)"
            )
        check_opacus_arguments({"batch_first": batch_first, "rand_on_empty": rand_on_empty})
        return cls(data_loader, make_source(SAMPLING, None))

    @property
    def batches_drawn(self) -> int:
        """Poisson batches drawn from this loader so far (by every iteration of it)."""
        return self.batch_sampler.drawn


def split_batch(batch: Any, max_rows: int) -> list[Any]:
    """Consecutive pieces of `batch` (tensors, or lists/tuples/dicts of them) of at most `max_rows` rows each."""
    rows = _num_rows(batch)
    if rows == 0:
        return [batch]
    return [_rows(batch, start, start + max_rows) for start in range(0, rows, max_rows)]


def _num_rows(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = list(batch.values()) if isinstance(batch, dict) else list(batch)
    counts = {_num_rows(v) for v in values}
    if len(counts) != 1:
        raise ParameterError(
            f"data_loader: the parts of a batch have different numbers of rows {sorted(counts)}; cannot split it"
        )
    return counts.pop()


def _rows(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, dict):
        return {key: _rows(value, start, stop) for key, value in batch.items()}
    return type(batch)(_rows(b, start, stop) for b in batch)


class BatchMemoryManager:
    """`with BatchMemoryManager(data_loader=..., max_physical_batch_size=..., optimizer=...) as loader:`.

    The loader yields physical batches; optimizer.step() after each one accumulates the
    clipped per-example gradients and steps (adding noise once) after a logical batch's last.
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer: Any) -> None:
        if max_physical_batch_size < 1:
            raise ParameterError(f"max_physical_batch_size must be >= 1, got {max_physical_batch_size}")
        if not hasattr(optimizer, "signal_skip_step"):
            raise ParameterTypeError("optimizer: BatchMemoryManager needs the optimizer returned by make_private")
        self.data_loader, self.max_physical_batch_size, self.optimizer = data_loader, max_physical_batch_size, optimizer

    def __enter__(self) -> Iterator[Any]:
        return self._physical_batches()

    def __exit__(self, *exc_info: object) -> None:
        self.optimizer.signal_skip_step(False)

    def _physical_batches(self) -> Iterator[Any]:
        for batch in self.data_loader:
            pieces = split_batch(batch, self.max_physical_batch_size)
            for index, piece in enumerate(pieces):
                self.optimizer.signal_skip_step(index < len(pieces) - 1)
                yield piece
