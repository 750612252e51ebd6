"""Ghost clipping (ghost.py): the clipped sum equals a per-example loop's, without every per-example gradient."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equiconvert
from equiconvert.nn.conv import SteerableConv2d
from equiconvert.privacy import ghost
from equiconvert.privacy.backends import UnknownBackendError, backend_for
from equiconvert.training.dp_config import PER_SAMPLE_METHODS
from equiconvert.privacy.dp_step import clip_factors
from equiconvert.privacy.ghost import accumulate_clipped_ghost, layer_squared_norms
from equiconvert.training.trainer import DPTrainer
from tests.support.tiny import perturbed


class SmallNet(nn.Module):
    """Two convs (one strided), a group norm with affine parameters and a linear head: C4 makes them steerable."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.down(F.relu(self.norm(self.stem(x)))))
        return self.head(x.mean((2, 3)))


MODELS = {
    "C4 small (steerable convs, norm, linear)": lambda: equiconvert.make_equivariant(SmallNet(), "C4"),
    "C4 small, weight standardization": lambda: equiconvert.make_equivariant(
        SmallNet(), "C4", config={"weight_standardization": True}
    ),
    "C4 small, layer weight standardization in escnn's coordinates": lambda: equiconvert.make_equivariant(
        SmallNet(), "C4", config={"weight_standardization": "layer", "standardization_coordinates": "escnn"}
    ),
}


def _naive_clipped_sum(model, views, labels, max_grad_norm):
    """Each example's gradient of its mean loss over its views by its own backward, clipped, summed."""
    summed = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for example in range(len(views)):
        model.zero_grad()
        F.cross_entropy(model(views[example]), labels[example].expand(views.shape[1])).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.stack([g.pow(2).sum() for g in grads.values()]).sum().sqrt()
        factor = clip_factors(norm, max_grad_norm)
        for name, grad in grads.items():
            summed[name] += factor * grad
    model.zero_grad()
    return summed


def _data(batch=5, views=2, size=12):
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(batch, views, 3, size, size, generator=generator)
    return images, torch.randint(0, 10, (batch,), generator=generator)


@pytest.mark.parametrize("name", list(MODELS))
def test_ghost_clipped_sum_equals_a_per_example_loop(name):
    torch.manual_seed(0)
    model = perturbed(MODELS[name]())
    assert any(isinstance(m, SteerableConv2d) for m in model.modules())
    views, labels = _data()
    max_grad_norm = 0.5  # clips some examples and not others: both sides of the clip factor
    summed = {}
    losses, nonfinite = accumulate_clipped_ghost(model, views, labels, F.cross_entropy, max_grad_norm, summed)
    expected = _naive_clipped_sum(model, views, labels, max_grad_norm)
    assert list(summed) == list(expected) and int(nonfinite) == 0
    for key, value in expected.items():
        torch.testing.assert_close(summed[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())  # restored, nothing accumulated
    assert losses.shape == (len(views),)


def test_steerable_conv_norms_are_the_coefficient_gradient_norms():
    """The norm clipped is that of the basis coefficients' gradient (what DP-SGD updates), not the dense filter's."""
    torch.manual_seed(0)
    model = perturbed(equiconvert.make_equivariant(SmallNet(), "C4"))
    conv = next(m for m in model.modules() if isinstance(m, SteerableConv2d) and m.bias is not None)
    batch, views = 3, 2
    inputs = torch.randn(batch * views, conv.in_channels, 7, 7)
    grad_out = torch.randn_like(conv(inputs))
    squares, finite = layer_squared_norms(conv, inputs, grad_out, views, ("weight", "bias"))
    for example in range(batch):
        rows = slice(example * views, (example + 1) * views)
        grads = torch.autograd.grad(conv(inputs[rows]), list(conv.parameters()), grad_out[rows])
        expected = sum(g.pow(2).sum() for g in grads)
        torch.testing.assert_close(squares[example], expected, rtol=1e-5, atol=1e-7)
    assert bool(finite.all())


def test_slices_of_one_example_give_the_same_sum(monkeypatch):
    torch.manual_seed(0)
    model = perturbed(equiconvert.make_equivariant(SmallNet(), "C4"))
    views, labels = _data()
    whole, sliced = {}, {}
    accumulate_clipped_ghost(model, views, labels, F.cross_entropy, 0.5, whole)
    monkeypatch.setattr(ghost, "SLICE_BYTES", 1)
    accumulate_clipped_ghost(model, views, labels, F.cross_entropy, 0.5, sliced)
    for key in whole:
        torch.testing.assert_close(sliced[key], whole[key], rtol=1e-6, atol=1e-7)


def test_a_nonfinite_example_adds_nothing_and_is_counted():
    torch.manual_seed(0)
    model = perturbed(equiconvert.make_equivariant(SmallNet(), "C4"))
    views, labels = _data()
    views[2, 1, 0, 3, 3] = float("nan")
    summed = {}
    _, nonfinite = accumulate_clipped_ghost(model, views, labels, F.cross_entropy, 0.5, summed)
    keep = torch.tensor([0, 1, 3, 4])
    expected = _naive_clipped_sum(model, views[keep], labels[keep], 0.5)
    assert int(nonfinite) == 1
    for key, value in expected.items():
        torch.testing.assert_close(summed[key], value, rtol=1e-5, atol=1e-5, msg=key)


def test_ghost_is_registered_for_fp32_only():
    backend = backend_for("ghost", "fp32")
    assert backend.clipped_sum is not None and backend.method == "ghost"
    assert "ghost" in PER_SAMPLE_METHODS
    # its bf16 path is not checked against book-keeping's: refused rather than served unchecked
    with pytest.raises(UnknownBackendError, match="ghost"):
        backend_for("ghost", "bf16")


def test_dptrainer_ghost_step_equals_bookkeeping_step():
    """The same seeded sampling and noise: one DPTrainer step by ghost clipping and by book-keeping agree."""
    images = torch.randint(0, 256, (12, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(12) % 10
    params = {}
    for method in ("bookkeeping", "ghost"):
        torch.manual_seed(0)
        trainer = DPTrainer(
            perturbed(equiconvert.make_equivariant(SmallNet(), "C4")),
            device="cpu",
            progress=False,
            per_sample_method=method,
            target_epsilon=None,
            noise_multiplier=1.0,
            max_grad_norm=0.5,
            batch_size=6,
            physical_batch_size=4,  # more than one physical batch per step: the sums accumulate
            aug_mult=2,
            steps=1,
            ema_decay=None,
            insecure_seeded_noise=True,
        )
        trainer.fit((images, labels))
        assert trainer.per_sample_method == method
        params[method] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for key, value in params["bookkeeping"].items():
        torch.testing.assert_close(params["ghost"][key], value, rtol=1e-5, atol=1e-6, msg=key)
