"""Initial filter scale under weight standardization: the forward pass ignores it, the gradient goes as 1/scale.

This is what `init_gain` relies on, checked exactly, and benchmarks/gradient_shares.py reporting it.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from equiconvert.models import equivariant_resnet9
from equiconvert.nn import SteerableConv2d
from tests.support.benchmark_scripts import load_benchmark


def _logits_after_backward(model):
    torch.manual_seed(1)
    x, y = torch.randn(4, 1, 32, 32, dtype=torch.float64), torch.tensor([0, 3, 5, 9])
    logits = model(x)
    F.cross_entropy(logits, y).backward()
    return logits.detach()


def test_weight_standardized_filters_forward_alike_and_their_gradients_scale_as_one_over_their_scale():
    """Filters c times smaller (what init_gain does, tests/models/test_equivariant_resnet9.py): same logits, gradients c x."""
    torch.manual_seed(0)
    he = equivariant_resnet9("D1", in_channels=1, layout=(8, 16, 16)).eval().double()
    small = copy.deepcopy(he)
    c = 2**0.5 / 0.5  # He's gain over 0.5
    convs = [(a, b) for a, b in zip(he.modules(), small.modules()) if isinstance(a, SteerableConv2d)]
    with torch.no_grad():
        for a, b in convs:
            a.eps = b.eps = 0.0  # exact without the standardization's eps (1e-5, on variances ~1e-3)
            b.weight.div_(c)
    assert len(convs) == 8
    assert torch.allclose(_logits_after_backward(he), _logits_after_backward(small), rtol=1e-10, atol=1e-12)
    for (name, a), (_, b) in zip(he.named_modules(), small.named_modules()):
        if isinstance(a, SteerableConv2d):
            assert torch.allclose(a.weight.grad * c, b.weight.grad, rtol=1e-9, atol=1e-14), name
            assert torch.allclose(a.bias.grad, b.bias.grad, rtol=1e-9, atol=1e-14), name
        elif isinstance(a, torch.nn.Linear):
            assert torch.allclose(a.weight.grad, b.weight.grad, rtol=1e-9, atol=1e-14), name


def test_benchmark_reports_the_classifier_share_falling_with_the_gain(tmp_path, capsys):
    out = tmp_path / "shares.json"
    assert (
        load_benchmark("gradient_shares").main(
            ["--dataset", "synthetic", "--group", "D1", "--gains", "1.4142,0.5", "--examples", "6", "--out", str(out)]
        )
        == 0
    )
    result = json.loads(out.read_text())
    printed = capsys.readouterr()
    assert json.loads(printed.out) == result and printed.err == ""
    assert result["split"] == "test" and "private" not in result  # not training data unless asked for
    he, small = result["converted"]["1.4142"], result["converted"]["0.5"]
    assert 0 < small["classifier_share"] < he["classifier_share"] < 1
    assert small["median_norm"] > he["median_norm"]  # conv gradients 2.83x larger, classifier's alike
    assert 0 < result["plain"]["classifier_share"] < 1
    assert any(name.endswith("head.2.weight") for name in he["layer_shares"])


@pytest.mark.parametrize("split", [None, "test", "train"])
def test_benchmark_at_a_checkpoint_reports_the_trained_weights_norms_on_the_split(tmp_path, capsys, split):
    """--checkpoint: the per-example norms of the checkpoint's weights on --split's images (default test), against a
    per-example autograd loop; the training split warns once and is recorded as not private."""
    from equiconvert.data import load_dataset
    from equiconvert.models.equivariant_resnet9 import equivariant_resnet9
    from equiconvert.recipes.build_model import pad_images, padded_size

    data = load_dataset("synthetic", None, split=split or "test")
    images, labels = data.images[:6], data.labels[:6]
    torch.manual_seed(5)
    model = equivariant_resnet9("D1", len(data.classes), images.shape[1])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # not what a fresh model would hold
    torch.save({"model": model.state_dict()}, tmp_path / "checkpoint.pt")
    out = tmp_path / "trained.json"
    assert (
        load_benchmark("gradient_shares").main(
            [
                "--dataset",
                "synthetic",
                "--group",
                "D1",
                "--examples",
                "6",
                "--checkpoint",
                str(tmp_path / "checkpoint.pt"),
                "--out",
                str(out),
                *(["--split", split] if split else []),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    warning = capsys.readouterr().err
    if split == "train":
        assert result["split"] == "train" and result["private"] is False
        assert warning.count("\n") == 1 and "not private" in warning and "--split train" in warning
    else:
        assert result["split"] == "test" and "private" not in result and warning == ""
    trained = result["trained"]
    x = (pad_images(images, padded_size(model, images.shape[-1])).float() / 255 - 0.5) / 0.5
    model.eval()
    norms = []
    for i in range(len(labels)):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), labels[i : i + 1]).backward()
        norms.append(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    norms = torch.stack(norms)
    assert abs(trained["median_norm"] - float(norms.median())) < 1e-4 * float(norms.median())
    quantiles = [trained["norm_quantiles"][q] for q in ("0.1", "0.25", "0.5", "0.75", "0.9")]
    assert quantiles == sorted(quantiles) and abs(quantiles[2] - float(norms.quantile(0.5))) < 1e-4 * quantiles[2]
