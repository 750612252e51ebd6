"""Converted timm EfficientNet-B0 and ConvNeXt (ConvNeXt-T's layers at small widths) train with the DP trainer."""

import pytest
import timm
import torch
import torch.nn.functional as F

import equiconvert
from equiconvert.privacy.bookkeeping import per_sample_gradients_bookkeeping
from equiconvert.training.trainer import DPTrainer
from tests.support.tiny import perturbed

# float64 for EfficientNet-B0: its depth puts fp32 summation-order noise near 1e-5; ConvNeXt's float64 depthwise
# 7x7 per-example VJP hits a CPU slow_conv2d limitation under vmap, and fp32 is well inside the bound there
DTYPES = {"efficientnet_b0": torch.float64, "convnext_tiny (small widths)": torch.float32}
CASES = {
    "efficientnet_b0": lambda: equiconvert.make_equivariant(
        timm.create_model("efficientnet_b0", num_classes=3, drop_rate=0.0), "C4", head="invariant"
    ),
    "convnext_tiny (small widths)": lambda: equiconvert.make_equivariant(
        timm.create_model("convnext_tiny", num_classes=3, dims=(8, 16, 32, 64), depths=(1, 1, 1, 1)),
        "C4",
        head="invariant",
        config={"even_kernels": "grow"},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bookkeeping_per_sample_gradients_equal_a_naive_loop(name):
    torch.manual_seed(0)
    model = perturbed(CASES[name]()).to(DTYPES[name])
    size = model.default_input_size()
    images, labels = torch.randn(3, 3, size, size, dtype=DTYPES[name]), torch.randint(0, 3, (3,))
    grads, _ = per_sample_gradients_bookkeeping(model, images.unsqueeze(1), labels)
    for i in range(len(images)):
        model.zero_grad()
        F.cross_entropy(model(images[i : i + 1]), labels[i : i + 1]).backward()
        for key, p in model.named_parameters():
            error = (grads[key][i] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)
            assert error <= 1e-5, (key, i, float(error))


@pytest.mark.parametrize("name", list(CASES))
def test_dp_trainer_takes_bookkeeping_steps(name):
    torch.manual_seed(0)
    model = CASES[name]()
    # at least 64: at ConvNeXt's smallest valid size (61) its last stage is 1x1, where the trainer's float64
    # probe of the depthwise 7x7 conv hits a CPU slow_conv2d stride check under vmap
    size = next(s for s in model.report.valid_input_sizes if s >= 64)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    data = (torch.randint(0, 256, (16, 3, size, size), dtype=torch.uint8), torch.randint(0, 3, (16,)))
    trainer = DPTrainer(
        model,
        target_epsilon=8.0,
        batch_size=4,
        steps=2,
        aug_mult=1,
        augment_padding=0,
        progress=False,
        device="cpu",
        per_sample_method="bookkeeping",
        physical_batch_size=4,
    )
    trainer.fit(data)
    assert trainer.step == 2 and trainer.per_sample_method == "bookkeeping"
    after = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
