"""Opacus' GradSampleModule / DPOptimizer / DPDataLoader names on make_private's objects: Opacus' meaning, or a
one-line refusal saying why and what to do."""

import warnings

import opacus.data_loader
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.data import DataLoader, TensorDataset

from equiconvert.errors import CallOrderError
from equiconvert.privacy import make_private
from equiconvert.privacy.dp_loader import DPDataLoader
from equiconvert.privacy.opacus_parity import OpacusAttributeError


def _made(grad_sample_mode: str = "hooks", seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))
    data = TensorDataset(torch.randn(32, 1, 6, 6), torch.randint(0, 4, (32,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # debug_seed: reproducible, not private
        made = make_private(
            module=model,
            optimizer=optimizer,
            data_loader=DataLoader(data, batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode=grad_sample_mode,
            debug_seed=seed,
        )
    return model, made


def _backward(module, criterion=F.cross_entropy):
    x, y = torch.randn(5, 1, 6, 6), torch.randint(0, 4, (5,))
    criterion(module(x), y).backward()
    return x, y


def test_grad_sample_after_backward_is_each_examples_gradient_until_the_step_consumes_it():
    model, (module, optimizer, _) = _made()
    x, y = _backward(module)
    params = dict(model.named_parameters())

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    expected = vmap(grad(loss), in_dims=(None, 0, 0))({k: v.detach() for k, v in params.items()}, x, y)
    for name, p in params.items():
        torch.testing.assert_close(p.grad_sample, expected[name], rtol=1e-4, atol=1e-6)
    assert [g.shape for g in optimizer.grad_samples] == [expected[n].shape for n in params]
    assert optimizer.accumulated_iterations == 1
    optimizer.step()
    assert optimizer.accumulated_iterations == 0 and all(p.grad_sample is None for p in model.parameters())


def test_pre_step_then_the_wrapped_step_equals_step():
    stepped, (module, optimizer, _) = _made(seed=3)
    torch.manual_seed(7)
    _backward(module)
    optimizer.step()
    pre_stepped, (module2, optimizer2, _) = _made(seed=3)
    torch.manual_seed(7)
    _backward(module2)
    assert optimizer2.pre_step() is True and optimizer2.steps == 1
    optimizer2.original_optimizer.step()
    for a, b in zip(stepped.parameters(), pre_stepped.parameters()):
        torch.testing.assert_close(a, b)
    optimizer2.signal_skip_step(True)
    _backward(module2)
    assert optimizer2.pre_step() is False and optimizer2.steps == 1  # accumulated only


def test_disabled_hooks_give_ordinary_gradients_and_refuse_a_private_step_until_enabled():
    model, (module, optimizer, _) = _made()
    module.disable_hooks()
    assert not module.hooks_enabled
    _backward(module)
    assert model[0].weight.grad is not None and model[0].weight.grad_sample is None
    with pytest.raises(CallOrderError, match="hooks are disabled.*enable_hooks"):
        optimizer.step()
    optimizer.zero_grad()
    module.enable_hooks()
    _backward(module)
    optimizer.step()
    assert optimizer.steps == 1


def test_removed_hooks_are_final_and_to_standard_module_returns_the_plain_model():
    model, (module, optimizer, _) = _made()
    module.remove_hooks()
    with pytest.raises(CallOrderError, match="removed.*make_private on the model again"):
        module.enable_hooks()
    assert module.to_standard_module() is model
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_named_submodules_are_attributes_as_in_opacus():
    model, (module, _, _) = _made()
    assert getattr(module, "3") is model[3]
    assert not hasattr(module, "no_such_layer")


@pytest.mark.parametrize(
    "owner, name, reason",
    [
        ("module", "allow_grad_accumulation", "BatchMemoryManager"),
        ("optimizer", "add_noise", "pre_step"),
        ("optimizer", "scale_grad", "pre_step"),
        ("optimizer", "generator", "secret generator"),
        ("optimizer", "step_hook", "attach_step_hook"),
    ],
)
def test_refused_opacus_names_say_why_and_what_to_do(owner, name, reason):
    _, (module, optimizer, _) = _made()
    target = {"module": module, "optimizer": optimizer}[owner]
    with pytest.raises(OpacusAttributeError, match=f"{name}.* is not supported: .*{reason}"):
        value = getattr(target, name)
        value()
    module.forbid_grad_accumulation()  # what Opacus' make_private does: already so here
    assert module.grad_accumulation_allowed is False


def test_ghost_clipping_forms_no_grad_sample_and_refuses_grad_samples():
    model, (module, optimizer, criterion, _) = _made("ghost")
    _backward(module, criterion)
    assert all(p.grad_sample is None for p in model.parameters())
    with pytest.raises(ValueError, match="ghost.*grad_sample_mode='hooks'"):
        optimizer.grad_samples


def test_the_loader_is_an_opacus_dp_data_loader_and_from_data_loader_samples_secretly():
    _, (_, _, loader) = _made()
    assert isinstance(loader, opacus.data_loader.DPDataLoader) and loader.sample_rate == 1 / 4
    plain = DataLoader(TensorDataset(torch.randn(20, 2)), batch_size=5)
    made = DPDataLoader.from_data_loader(plain)
    assert isinstance(made, DPDataLoader) and made.sample_rate == 1 / 4 and len(made) == 4
    with pytest.raises(ValueError, match="generator=.*seedable"):
        DPDataLoader.from_data_loader(plain, generator=torch.Generator())
    with pytest.raises(ValueError, match="distributed=True"):
        DPDataLoader.from_data_loader(plain, distributed=True)
