"""torch.func's per-example gradients (privacy/per_sample.py) on a model whose forward rebinds a frozen tensor's `.data`
from the batch: one clear refusal, where torch used to crash the whole process (SIGSEGV)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from equiconvert.errors import PrivacyError
from equiconvert.privacy.per_sample import StateRebindingError, per_sample_gradients


class _RebindsFrozenScale(nn.Module):
    """Stores the batch's mean feature in a frozen parameter (by `.data =`) whenever gradients are on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.scale.data = x.mean(0).detach()
        return self.linear(x * self.scale)


def _gradients(model: nn.Module, views: torch.Tensor, labels: torch.Tensor):
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    return per_sample_gradients(model, params, dict(model.named_buffers()), views, labels)


def test_a_forward_rebinding_a_frozen_parameter_from_the_batch_is_refused_naming_it():
    model = _RebindsFrozenScale()
    with pytest.raises(
        StateRebindingError, match=r"rebinds 'scale' \(`\.data = \.\.\.`\) under per-example gradients"
    ) as caught:
        _gradients(model, torch.randn(3, 2, 4), torch.tensor([0, 1, 2]))
    assert isinstance(caught.value, PrivacyError)
    assert torch.equal(model.scale, torch.ones(4))  # the model's own tensor was never rebound
    torch.testing.assert_close(model(torch.ones(2, 4)), model.linear(torch.ones(2, 4)))  # and is still usable
