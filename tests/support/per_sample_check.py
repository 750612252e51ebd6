"""Shared check: torch.func per-sample gradients equal a naive per-example backward loop."""

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap


def assert_per_sample_gradients_match_loop(model, x: torch.Tensor, y: torch.Tensor, tolerance: float = 1e-5) -> None:
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, (p, buffers), (xi.unsqueeze(0),)), yi.unsqueeze(0))

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for name, p in model.named_parameters():
            error = (per_sample[name][i] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)
            assert error <= tolerance, (name, float(error))
