"""Frozen parameters (requires_grad=False) are untrained state like buffers: one that a forward writes from the
batch only under grad, or that a backward hook writes, is refused by both front-ends before it leaves the model."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from equiconvert.privacy.validate import PrivacyValidationError
from tests.privacy.test_buffer_leaks import _data, _make_private, _model, _one_private_step, _trainer


class CountsUnderGrad(nn.Module):
    """Adds each batch's size to a frozen parameter, only when autograd records (training, not a no_grad probe) and
    outside torch.func (whose transforms refuse the write)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not torch._C._functorch.is_functorch_wrapped_tensor(x):
            self.seen.add_(x.shape[0])
        return x


class CountsInBackward(nn.Module):
    """Adds each batch's size to a frozen parameter from a gradient hook, which no forward-only probe runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        if y.requires_grad:
            y.register_hook(self._count)
        return y

    def _count(self, grad: torch.Tensor) -> None:
        if not torch._C._functorch.is_functorch_wrapped_tensor(grad):  # torch.func refuses the write: skip it there
            with torch.no_grad():
                self.seen.add_(grad.shape[0])


@pytest.mark.parametrize("counter", [CountsUnderGrad, CountsInBackward])
def test_attack_a_frozen_parameter_counting_batches_is_refused_by_the_trainer(counter):
    """The attack: train, then read the released frozen parameter, the sum of the secret Poisson batch sizes."""
    model = _model(counter())
    trainer = _trainer(model, steps=3)
    with pytest.raises(PrivacyValidationError, match=r"module '2' change.* 'seen'"):
        trainer.fit(_data(16))
    assert float(model[2].seen) == 0.0  # nothing of the batches is left in the model


@pytest.mark.parametrize("counter", [CountsUnderGrad, CountsInBackward])
def test_attack_a_frozen_parameter_counting_batches_is_refused_by_make_private(counter):
    model = _model(counter())
    images, labels = _data(16)
    private, optimizer, loader = _make_private(model, images, labels)
    with pytest.raises(PrivacyValidationError, match=r"module '2' change.* 'seen'"):
        for batch, targets in itertools.islice(loader, 4):
            _one_private_step(private, optimizer, batch, targets)
    assert float(model[2].seen) == 0.0
    assert optimizer.steps == 0  # refused before the first noisy step took the batch's gradients


def test_the_run_time_guard_names_and_sets_back_a_frozen_parameter():
    from equiconvert.privacy.buffer_guard import BufferGuard

    model = nn.Sequential(CountsUnderGrad()).train()
    guard = BufferGuard(model)
    batch = torch.zeros(5, 3)
    with pytest.raises(PrivacyValidationError, match=r"module '0' changed its frozen parameter 'seen'"):
        with guard.watch(batch):
            model(batch)
    assert float(model[0].seen) == 0.0 and not model[0].seen.requires_grad


def test_a_frozen_parameter_written_in_backward_is_refused_at_the_opacus_helpers_optimizer_step():
    pytest.importorskip("opacus")
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from equiconvert.privacy.opacus_interop import make_private as opacus_make_private

    model = _model(CountsInBackward())
    images, labels = _data()
    loader = DataLoader(TensorDataset(images, labels), batch_size=4)
    with pytest.warns(UserWarning, match="secure_mode=False"):
        private, optimizer, _ = opacus_make_private(
            PrivacyEngine(),
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
        )
    with pytest.raises(PrivacyValidationError, match=r"module '2' changed its frozen parameter 'seen' in a training"):
        _one_private_step(private, optimizer, images[:4], labels[:4])
    assert float(model[2].seen) == 0.0
