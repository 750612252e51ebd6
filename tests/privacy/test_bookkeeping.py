"""Book-keeping per-sample gradients equal torch.func's, layer type by layer type, and fail loudly."""

import copy

import pytest
import torch
import torch.nn.functional as F
from opacus.validators import ModuleValidator
from torch import nn

import equiconvert
from equiconvert.models import equivariant_resnet9, resnet9
from equiconvert.models.equivariant_resnet9 import plain_paper_resnet9
from equiconvert.privacy.bookkeeping import (
    BookkeepingUnsupportedError,
    check_bookkeeping_supported,
    per_sample_gradients_bookkeeping,
    verify_bookkeeping,
)
from equiconvert.privacy.per_sample import per_sample_gradients
from equiconvert.training.trainer import DPTrainer
from equiconvert.privacy.validate import PrivacyValidationError
from tests.support.tiny import perturbed


class DepthwiseNet(nn.Module):
    """Grouped (depthwise) conv, reflect padding, conv bias: the layers that take the generic VJP or a pre-pad."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, padding_mode="reflect")
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.norm = nn.GroupNorm(4, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.norm(self.depthwise(F.relu(self.stem(x)))))
        return self.head(x.mean((2, 3)))


class DenseWithImage(nn.Module):
    """The image concatenated beside a block's maps (a direct sum): the next conv reads trivial and regular parts."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ELU())
        self.mix = nn.Conv2d(19, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = F.elu(self.mix(torch.cat((x, self.block(x)), 1)))
        return self.head(x.mean((2, 3)))


class TinyUNet(nn.Module):
    """Down by a max pool, up by a 2x2 stride-2 transposed conv, the skip concatenated."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.down = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.MaxPool2d(2))
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        skip = F.relu(self.stem(x))
        x = F.relu(self.up(F.relu(self.down(skip))))
        return self.head(torch.cat((x, skip), 1).mean((2, 3)))


MODELS = {
    "paper D4 (weight standardization, restriction, conv bias)": lambda: equivariant_resnet9("D4"),
    "resnet9 D4 (field group norm with affine)": lambda: equiconvert.make_equivariant(
        resnet9(widths=(8, 16, 32)), "D4", head="invariant"
    ),
    "plain baseline (Conv2d, GroupNorm)": lambda: ModuleValidator.fix(resnet9(widths=(8, 16, 32))),
    "plain paper network (conv bias)": plain_paper_resnet9,
    "O2 (group standardization)": lambda: equiconvert.make_equivariant(
        resnet9(widths=(8, 16, 32)), "O2", head="invariant"
    ),
    "C4 depthwise, reflect padding": lambda: equiconvert.make_equivariant(DepthwiseNet(), "C4", head="invariant"),
    "plain depthwise": DepthwiseNet,
    "D4 direct sum (image beside regular fields)": lambda: equiconvert.make_equivariant(DenseWithImage(), "D4"),
    "C4 transposed conv": lambda: equiconvert.make_equivariant(TinyUNet(), "C4", input_size=32),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_bookkeeping_equals_vmap_per_sample_gradients(name):
    torch.manual_seed(0)
    model = perturbed(MODELS[name]())
    views, labels = torch.randn(5, 2, 3, 32, 32), torch.randint(0, 10, (5,))
    params = {n: p.detach() for n, p in model.named_parameters()}
    expected, expected_losses = per_sample_gradients(model, params, dict(model.named_buffers()), views, labels)
    grads, losses = per_sample_gradients_bookkeeping(model, views, labels)
    assert list(grads) == list(expected)
    for key in expected:
        error = (grads[key] - expected[key]).norm() / expected[key].norm().clamp_min(1e-12)
        assert error < 1e-5, (key, float(error))
    assert torch.allclose(losses, expected_losses, atol=1e-6)
    assert all(p.requires_grad and p.grad is None for p in model.parameters())  # restored, nothing accumulated


CONV_SHAPES = {  # kernel, stride, padding, dilation, padding_mode: the shifted-product path and the patches path
    "3x3 pad 1": dict(kernel_size=3, padding=1),
    "3x3 no padding": dict(kernel_size=3, padding=0),
    "1x1": dict(kernel_size=1),
    "5x3 pad (3, 2), wider than needed": dict(kernel_size=(5, 3), padding=(3, 2)),
    "3x3 circular": dict(kernel_size=3, padding=1, padding_mode="circular"),
    "3x3 stride 2 (patches view)": dict(kernel_size=3, padding=1, stride=2),
    "3x3 dilation 2 (patches view)": dict(kernel_size=3, padding=2, dilation=2),
}


@pytest.mark.parametrize("views", [1, 3])
@pytest.mark.parametrize("shape", list(CONV_SHAPES))
def test_conv_filter_gradients_equal_a_per_example_loop(shape, views):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 5, **CONV_SHAPES[shape]), nn.Flatten(), nn.LazyLinear(4))
    batch = 3
    images, labels = torch.randn(batch, views, 3, 11, 9), torch.randint(0, 4, (batch,))
    model(images[:, 0])  # materialises the lazy head
    grads, _ = per_sample_gradients_bookkeeping(model, images, labels)
    for example in range(batch):
        model.zero_grad()
        F.cross_entropy(model(images[example]), labels[example].expand(views)).backward()
        for name, param in model.named_parameters():
            torch.testing.assert_close(grads[name][example], param.grad, rtol=1e-5, atol=1e-6)


def test_conv_rule_casts_and_lays_out_a_strided_bf16_filter_gradient_in_one_copy(monkeypatch):
    """The products' bf16 filter gradient is a permuted view; the rule returns it contiguous in the weight's dtype,
    with one copy (a cast that kept the view's strides, then `.contiguous()`, would move it twice)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from equiconvert.privacy import bookkeeping
    from equiconvert.privacy.filter_gradients import filter_gradient_method

    conv = nn.Conv2d(8, 16, 3, padding=1, bias=False)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(6, 8, 7, 7, generator=generator).bfloat16()
    grad_out = torch.randn(6, 16, 7, 7, generator=generator).bfloat16()
    with filter_gradient_method("products"):
        strided = bookkeeping._filter_gradients(conv, inputs, grad_out, 2)
    assert not strided.is_contiguous()
    monkeypatch.setattr(bookkeeping, "_filter_gradients", lambda *args: strided)

    class CopyCount(TorchDispatchMode):
        copies = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_to_copy", "copy_", "clone"):
                CopyCount.copies += 1
            return func(*args, **(kwargs or {}))

    with CopyCount():
        weight = bookkeeping._conv_rule(conv, inputs, grad_out, 2)["weight"]
    assert CopyCount.copies == 1
    assert weight.dtype == torch.float32 and weight.is_contiguous()
    assert torch.equal(weight, strided.float())


def test_sample_gradient_does_not_depend_on_the_others():
    model = perturbed(equivariant_resnet9("D4"))
    views, labels = torch.randn(4, 2, 3, 32, 32), torch.randint(0, 10, (4,))
    first, _ = per_sample_gradients_bookkeeping(model, views, labels)
    changed = views.clone()
    changed[1:] = torch.randn_like(changed[1:]) * 5
    second, _ = per_sample_gradients_bookkeeping(model, changed, labels)
    for key in first:
        assert torch.allclose(first[key][0], second[key][0], rtol=1e-5, atol=1e-7), key


class TwiceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.conv(self.conv(x)).mean((2, 3)))


def test_a_layer_run_twice_is_refused():
    views, labels = torch.randn(3, 1, 3, 8, 8), torch.randint(0, 2, (3,))
    with pytest.raises(BookkeepingUnsupportedError, match="'conv' runs more than once"):
        per_sample_gradients_bookkeeping(TwiceNet(), views, labels)
    images = torch.randint(0, 256, (32, 3, 8, 8), dtype=torch.uint8)
    trainer = DPTrainer(
        TwiceNet(),
        target_epsilon=8.0,
        batch_size=8,
        steps=1,
        aug_mult=1,
        augment_padding=2,
        progress=False,
        per_sample_method="bookkeeping",
        device="cpu",
    )
    with pytest.raises(BookkeepingUnsupportedError):
        trainer.fit((images, torch.randint(0, 2, (32,))))
    assert all(p.requires_grad for p in trainer.model.parameters())  # restored after the failure


def test_shared_parameters_are_refused_by_the_static_check():
    model = TwiceNet()
    model.other = nn.Linear(3, 2)
    model.other.weight = model.head.weight
    with pytest.raises(BookkeepingUnsupportedError, match="shared by layers"):
        check_bookkeeping_supported(model)
    with pytest.raises(BookkeepingUnsupportedError, match="shared by layers"):  # refused before training
        DPTrainer(model, target_epsilon=8.0, per_sample_method="bookkeeping", progress=False, device="cpu")


class FunctionalBatchStatsNet(nn.Module):
    """Mixes examples through batch statistics that no module type reveals (F.batch_norm in training mode)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = F.batch_norm(self.conv(x), None, None, training=True)
        return self.head(F.relu(x).mean((2, 3)))


class ReusedWeightNet(nn.Module):
    """Uses a conv's weight a second time outside the conv module: book-keeping would miss that use."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        return self.head(F.conv2d(h, self.conv.weight, padding=1).mean((2, 3)))


PROBE_OPTIONS = dict(
    target_epsilon=8.0,
    batch_size=8,
    steps=2,
    aug_mult=2,
    augment_padding=2,
    progress=False,
    device="cpu",
    physical_batch_size=4,
    insecure_seeded_noise=True,
)  # runs are compared bit for bit


def _fit(model, method, data):
    trainer = DPTrainer(copy.deepcopy(model), per_sample_method=method, **PROBE_OPTIONS)
    trainer.fit(data)
    return trainer


@pytest.mark.parametrize(
    "model, reason",
    [
        (TwiceNet(), "'conv' runs more than once"),
        (ReusedWeightNet(), "differs from torch.func's"),
    ],
)
def test_auto_falls_back_to_vmap_where_bookkeeping_fails_its_probe(model, reason):
    torch.manual_seed(0)
    data = (torch.randint(0, 256, (32, 3, 8, 8), dtype=torch.uint8), torch.randint(0, 2, (32,)))
    with pytest.raises(BookkeepingUnsupportedError, match=reason):
        verify_bookkeeping(model, (2, 3, 8, 8))
    with pytest.warns(UserWarning, match="bookkeeping cannot run this model.*using vmap"):
        auto = _fit(model, "auto", data)
    assert auto.per_sample_method == "vmap"
    reference = _fit(model, "vmap", data)  # the probe used no RNG of the run: bit-identical to plain vmap
    for (name, value), expected in zip(auto.model.state_dict().items(), reference.model.state_dict().values()):
        assert torch.equal(value, expected), name
    with pytest.raises(BookkeepingUnsupportedError, match=reason):
        _fit(model, "bookkeeping", data)


def test_functional_batch_statistics_are_refused_whatever_the_method():
    """Batch mixing is not a per-sample-method matter: check_dp_safe refuses the model before training."""
    data = (torch.randint(0, 256, (32, 3, 8, 8), dtype=torch.uint8), torch.randint(0, 2, (32,)))
    with pytest.raises(BookkeepingUnsupportedError, match="changes with the other examples of its batch"):
        verify_bookkeeping(FunctionalBatchStatsNet(), (2, 3, 8, 8))
    for method in ("auto", "vmap", "bookkeeping"):
        with pytest.raises(PrivacyValidationError, match="module '<root>' mixes examples"):
            _fit(FunctionalBatchStatsNet(), method, data)


def test_auto_takes_bookkeeping_where_its_probe_passes():
    torch.manual_seed(0)
    data = (torch.randint(0, 256, (32, 3, 16, 16), dtype=torch.uint8), torch.randint(0, 4, (32,)))
    model = equiconvert.make_equivariant(resnet9(widths=(8, 8, 8), num_classes=4), "C4", head="invariant")
    cpu_state = torch.get_rng_state()
    verify_bookkeeping(model, (2, 3, 16, 16))
    assert torch.equal(torch.get_rng_state(), cpu_state)  # the probe leaves the caller's RNG alone
    trainer = _fit(model, "auto", data)
    assert trainer.per_sample_method == "bookkeeping"
    shared = TwiceNet()
    shared.other = nn.Linear(3, 2)
    shared.other.weight = shared.head.weight
    assert DPTrainer(shared, **PROBE_OPTIONS).per_sample_method == "vmap"  # the static check, before any step


def test_trainer_steps_agree_between_methods():
    images = torch.randint(0, 256, (48, 3, 16, 16), dtype=torch.uint8)
    data = (images, torch.randint(0, 4, (48,)))
    model = equiconvert.make_equivariant(resnet9(widths=(8, 16, 32), num_classes=4), "D4", head="invariant")
    finals = []
    for method in ("vmap", "bookkeeping"):
        trainer = DPTrainer(
            copy.deepcopy(model),
            target_epsilon=8.0,
            batch_size=16,
            steps=2,
            aug_mult=2,
            physical_batch_size=8,
            per_sample_method=method,
            progress=False,
            device="cpu",
            insecure_seeded_noise=True,
        )  # the same noise and batches in both runs
        trainer.fit(data)
        assert trainer.config.per_sample_method == method
        finals.append(trainer.model.state_dict())
    for key in finals[0]:
        assert torch.allclose(finals[0][key], finals[1][key], rtol=1e-4, atol=1e-6), key


def test_a_run_resumes_with_the_other_per_sample_method(tmp_path):
    images = torch.randint(0, 256, (32, 3, 16, 16), dtype=torch.uint8)
    data = (images, torch.randint(0, 4, (32,)))
    model = equiconvert.make_equivariant(resnet9(widths=(8, 8, 8), num_classes=4), "C4", head="invariant")
    options = dict(
        target_epsilon=8.0, batch_size=8, steps=2, aug_mult=1, progress=False, device="cpu", out_dir=tmp_path
    )
    first = DPTrainer(copy.deepcopy(model), per_sample_method="vmap", **options)
    first.fit(data, time_limit_s=0.0)
    resumed = DPTrainer(copy.deepcopy(model), per_sample_method="bookkeeping", **options)
    resumed.fit(data, resume=True)
    assert resumed.step == 2 and resumed.config.per_sample_method == "bookkeeping"
    with pytest.raises(ValueError, match="different configuration"):
        DPTrainer(copy.deepcopy(model), **{**options, "steps": 3}).fit(data, resume=True)


class InPlaceAfterLinear(nn.Module):
    """The head's input is changed in place after the head ran: its kept input no longer is what it multiplied
    (autograd does not notice: with the weight frozen, the head's backward needs no input)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(12, 2)

    def forward(self, x):
        hidden = x.mean((2, 3)).repeat(1, 4)
        out = self.head(hidden)
        hidden.add_(1.0)
        return out + hidden.mean()


def test_bookkeeping_refuses_a_layer_input_changed_in_place_after_the_layer_ran():
    views, labels = torch.randn(3, 2, 3, 8, 8), torch.tensor([0, 1, 0])
    with pytest.raises(BookkeepingUnsupportedError, match=r"inputs of layers \['head'\] are modified in place"):
        per_sample_gradients_bookkeeping(InPlaceAfterLinear(), views, labels)


@pytest.mark.parametrize("views", [1, 3])
@pytest.mark.parametrize("shape", [(8, 5, 5), (8, 7)])
def test_group_norm_gradients_equal_the_per_example_vjp(views, shape):
    from equiconvert.privacy.bookkeeping import _group_norm_rule, _layer_vjp_rule

    generator = torch.Generator().manual_seed(0)
    norm = nn.GroupNorm(4, 8).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, generator=generator, dtype=torch.float64))
        norm.bias.copy_(torch.randn(8, generator=generator, dtype=torch.float64))
    inputs = 3 * torch.randn(4 * views, *shape, generator=generator, dtype=torch.float64) + 1
    grad_out = torch.randn(4 * views, *shape, generator=generator, dtype=torch.float64)
    got, expected = _group_norm_rule(norm, inputs, grad_out, views), _layer_vjp_rule(norm, inputs, grad_out, views)
    assert set(got) == set(expected) == {"weight", "bias"}
    for name in got:
        assert got[name].shape == (4, 8)
        torch.testing.assert_close(got[name], expected[name], rtol=1e-10, atol=1e-10)


def test_the_direct_sum_and_transposed_conv_models_gradients_equal_a_per_example_loop():
    from equiconvert.nn.conv_transpose import SteerableConvTranspose2d
    from equiconvert.nn.direct_sum import DirectSumConv2d
    from tests.support.per_sample_check import assert_per_sample_gradients_match_loop

    for name, layer in (
        ("D4 direct sum (image beside regular fields)", DirectSumConv2d),
        ("C4 transposed conv", SteerableConvTranspose2d),
    ):
        torch.manual_seed(0)
        model = perturbed(MODELS[name]())
        assert any(isinstance(m, layer) for m in model.modules())  # the layer under test is in the model
        assert_per_sample_gradients_match_loop(model, torch.randn(3, 3, 32, 32), torch.randint(0, 10, (3,)))
