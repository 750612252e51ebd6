"""make_private(grad_sample_mode="ghost"): ghost clipping (ghost.py) under the user's own loop, the same update as
book-keeping and a per-example loop, without every per-example gradient at once; fp32 only."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from equiconvert.errors import ParameterError
from equiconvert.privacy import PrivacyEngine, ghost, make_private
from equiconvert.privacy.private_module import PrivateModule
from tests.privacy.test_make_private import _naive, converted_model

LR = 0.5


def _made(model, x, y, mode, **options):
    """make_private's (module, optimizer, criterion) at a noise the test then turns off (sigma 0 in the step only)."""
    options = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "debug_seed": 0, **options}
    with pytest.warns(UserWarning, match="NOT differentially private"):
        made = make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)),
            grad_sample_mode=mode,
            **options,
        )
    private, optimizer = made[0], made[1]
    optimizer.noise_multiplier = 0.0  # make_private refuses sigma 0; the step then adds no noise
    criterion = made[2] if len(made) == 4 else F.cross_entropy
    return private, optimizer, criterion


def _update(start, x, y, mode, max_grad_norm, aug_mult=1, loss_reduction="mean"):
    """The parameter change of one noise-free step of the user's loop, by parameter name; and the module."""
    model = copy.deepcopy(start)
    private, optimizer, criterion = _made(
        model, x, y, mode, max_grad_norm=max_grad_norm, aug_mult=aug_mult, loss_reduction=loss_reduction
    )
    if criterion is F.cross_entropy:
        criterion = lambda logits, targets: F.cross_entropy(logits, targets, reduction=loss_reduction)  # noqa: E731
    optimizer.zero_grad()
    criterion(private(x), y.repeat_interleave(aug_mult)).backward()
    optimizer.step()
    before = dict(start.named_parameters())
    return {name: (p - before[name]).detach() for name, p in model.named_parameters()}, private


def _naive_update(start, x, y, max_grad_norm, divisor):
    """-lr * (sum of each example's gradient scaled to norm <= C, computed one example at a time) / divisor."""
    grads = _naive(copy.deepcopy(start), x, y)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    factors = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    return {name: -LR * torch.einsum("b,b...->...", factors, g) / divisor for name, g in grads.items()}, norms


@pytest.mark.parametrize("aug_mult, loss_reduction", [(1, "mean"), (2, "mean"), (1, "sum")])
def test_ghost_update_equals_bookkeeping_and_a_per_example_loop(aug_mult, loss_reduction):
    torch.manual_seed(0)
    start = converted_model()
    x = torch.randn(5, aug_mult, 3, 9, 9) if aug_mult > 1 else torch.randn(5, 3, 9, 9)
    y = torch.randint(0, 10, (5,))
    _, norms = _naive_update(start, x, y, 1.0, 1.0)
    clip = float(norms.median())  # some examples clipped, some not
    assert bool((norms > clip).any()) and bool((norms < clip).any())
    expected, _ = _naive_update(start, x, y, clip, len(x) if loss_reduction == "mean" else 1.0)
    ghosted, private = _update(start, x, y, "ghost", clip, aug_mult, loss_reduction)
    booked, _ = _update(start, x, y, "hooks", clip, aug_mult, loss_reduction)
    assert private.method == "ghost"
    for name, value in expected.items():
        assert value.abs().max() > 1e-4, name  # the step moves every parameter
        torch.testing.assert_close(ghosted[name], value, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(ghosted[name], booked[name], rtol=0, atol=1e-5, msg=name)


def test_ghost_never_holds_every_per_example_gradient(monkeypatch):
    """The ghost step forms each layer's per-example gradients one example at a time (SLICE_BYTES 1 byte) and never
    asks for the whole model's per-example gradients."""
    slices = []
    formed = ghost.layer_per_example_gradients

    def spy(module, inputs, grad_out, views):
        grads = formed(module, inputs, grad_out, views)
        slices.append(max(g.shape[0] for g in grads.values()))
        return grads

    def refused(self):
        raise AssertionError("every parameter's per-example gradients were formed at once")

    monkeypatch.setattr(ghost, "layer_per_example_gradients", spy)
    monkeypatch.setattr(ghost, "SLICE_BYTES", 1)
    monkeypatch.setattr(PrivateModule, "per_sample_gradients", refused)
    start, x, y = converted_model(), torch.randn(4, 3, 9, 9), torch.randint(0, 10, (4,))
    update, private = _update(start, x, y, "ghost", 1.0)
    layers = sum(1 for m in start.modules() if any(p.requires_grad for p in m.parameters(recurse=False)))
    assert slices == [1] * (layers * len(x))  # each layer, each example, alone
    assert all(bool(value.abs().max() > 0) for value in update.values())


def test_ghost_drops_a_non_finite_example_and_counts_it():
    start, x, y = converted_model(), torch.randn(4, 3, 9, 9), torch.randint(0, 10, (4,))
    corrupt = x.clone()
    corrupt[1, 0, 2, 2] = float("inf")
    model = copy.deepcopy(start)
    private, optimizer, criterion = _made(model, corrupt, y, "ghost")
    criterion(private(corrupt), y).backward()
    optimizer._accumulate()
    assert optimizer.nonfinite_gradients == 1
    clean, _ = _naive_update(start, x[[0, 2, 3]], y[[0, 2, 3]], 1.0, 1.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(optimizer._summed[p], clean[name] / -LR, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("entry", ["make_private", "engine.make_private", "engine.make_private_with_epsilon"])
def test_every_entry_point_runs_ghost_clipping_for_grad_sample_mode_ghost(entry):
    model = converted_model()
    data = TensorDataset(torch.randn(40, 3, 9, 9), torch.randint(0, 10, (40,)))
    common = {
        "module": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=LR),
        "data_loader": DataLoader(data, batch_size=4),
        "max_grad_norm": 1.0,
        "grad_sample_mode": "ghost",
    }
    if entry == "make_private":
        made = make_private(noise_multiplier=1.0, **common)
    elif entry == "engine.make_private":
        made = PrivacyEngine(accountant="rdp").make_private(noise_multiplier=1.0, **common)
    else:
        made = PrivacyEngine(accountant="rdp").make_private_with_epsilon(
            target_epsilon=5.0, target_delta=1e-3, epochs=1, **common
        )
    assert len(made) == 4 and made[0].method == "ghost"


def test_ghost_refuses_bf16_early_in_one_line():
    start, x, y = converted_model(), torch.randn(4, 3, 9, 9), torch.randint(0, 10, (4,))
    private, _, criterion = _made(copy.deepcopy(start), x, y, "ghost")
    with pytest.raises(ParameterError, match=r"grad_sample_mode='ghost' runs in fp32 only.*autocast") as error:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            private(x)
    assert "grad_sample_mode='hooks'" in str(error.value) and "\n" not in str(error.value)
    half = copy.deepcopy(start).to(torch.bfloat16)
    with pytest.raises(ParameterError, match=r"runs in fp32 only, but the model's trainable parameters are torch.bf"):
        make_private(
            module=half,
            optimizer=torch.optim.SGD(half.parameters(), lr=LR),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=4),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode="ghost",
        )
    hooks, _, _ = _made(copy.deepcopy(start), x, y, "hooks")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert hooks(x).shape == (4, 10)  # book-keeping takes bf16 autocast
