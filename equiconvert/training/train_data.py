"""Training and evaluation data for DPTrainer: tensors, a map-style Dataset or a DataLoader.

Poisson sampling draws indices of the whole set, so a Dataset is read by index, never through a
DataLoader's own sampler (its order is not the private sampling). A set that fits `in_memory_bytes`
is read once into tensors and kept on the device; a larger one is streamed: each step gathers its
sampled examples through the Dataset.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import ParameterError, ParameterTypeError
from .inputs import check_images, check_labels


class TrainData(ABC):
    """Examples addressable by index: `gather(indices)` -> (images, labels) on the data's device."""

    device: torch.device

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class TensorData(TrainData):
    """(images, labels) tensors, indexed where they are."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels
        self.device = images.device

    def __len__(self) -> int:
        return len(self.images)

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The examples at `indices`; labels as int64 class indices, what the losses take (int8 ones would fail
        there; check_labels refuses labels that are not integers)."""
        indices = indices.to(self.images.device)
        return self.images[indices], self.labels[indices.to(self.labels.device)].long()

    def to(self, device: torch.device) -> "TensorData":
        return TensorData(self.images.to(device), self.labels.to(device))


class StreamedData(TrainData):
    """A map-style Dataset read example by example at each gather (host memory; the trainer moves batches)."""

    def __init__(self, dataset: Dataset, what: str, num_classes: int | None = None) -> None:
        self.dataset, self.what, self.num_classes = dataset, what, num_classes
        self.device = torch.device("cpu")

    def __len__(self) -> int:
        return len(self.dataset)

    def gather(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = _stack([self.dataset[int(i)] for i in indices.tolist()], self.what)
        if len(images):
            check_images(images, self.what)
            if self.num_classes is not None:
                check_labels(labels, len(images), self.num_classes, self.what)
        return images, labels


def _example(item: Any, what: str) -> tuple[torch.Tensor, int]:
    """(image tensor, integer label) of one Dataset item, or a TypeError saying what the item must be."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor)):
        raise ParameterTypeError(
            f"{what}: a Dataset item must be (image tensor (C, H, W), integer label), got "
            f"{type(item).__name__}; give the Dataset a transform that returns tensors "
            "(e.g. torchvision.transforms.ToTensor())"
        )
    return item[0], int(item[1])


def _stack(items: list[Any], what: str) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [_example(item, what) for item in items]
    if not pairs:
        return torch.empty(0), torch.empty(0, dtype=torch.long)
    return torch.stack([image for image, _ in pairs]), torch.tensor([label for _, label in pairs], dtype=torch.long)


def as_train_data(data: Any, what: str, in_memory_bytes: int) -> TrainData:
    """`data` ((images, labels), a TensorDataset, a map-style Dataset or a DataLoader over one) as TrainData.

    A Dataset whose images take at most `in_memory_bytes` (estimated from its first example) is read into
    tensors once; a larger one is streamed.
    """
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        return TensorData(data[0], data[1])
    if isinstance(data, DataLoader):
        data = data.dataset
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, tuple) and len(tensors) == 2:  # torch.utils.data.TensorDataset
        return TensorData(*tensors)
    if not (isinstance(data, Dataset) and hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise ParameterTypeError(
            f"{what} must be (images, labels) tensors, a TensorDataset, a map-style Dataset of "
            f"(image, label) or a DataLoader over one, got {type(data).__name__}"
        )
    if len(data) == 0:
        raise ParameterError(f"{what} is empty; give at least one example")
    first, _ = _example(data[0], what)
    if len(data) * first.numel() * first.element_size() <= in_memory_bytes:
        return TensorData(*_stack([data[i] for i in range(len(data))], what))
    return StreamedData(data, what)
