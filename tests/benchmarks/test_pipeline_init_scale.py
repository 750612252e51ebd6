"""benchmarks/pipeline_init_scale.py: per-example gradient norms, clip shares and ratios to the original."""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from torch.utils.data import TensorDataset

from tests.support.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def init_scale():
    return load_benchmark("pipeline_init_scale")


def test_per_example_norms_match_vmapped_gradients(init_scale):
    from pipeline_gallery import PIPELINES

    torch.manual_seed(0)
    model = PIPELINES["opacus_cifar10"].build(0.25)
    images, labels = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, images, labels)
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
    clip = norms.median().item()
    measured = init_scale.measure(model, images, labels, clip)
    assert measured["grad_norm_median"] == pytest.approx(statistics.median(norms.tolist()), rel=1e-3)
    assert measured["clipped_share"] == pytest.approx((norms > clip).float().mean().item(), abs=1e-3)
    with torch.no_grad():
        assert measured["logit_std"] == pytest.approx(model(images).std().item(), rel=1e-3)


def test_the_summary_divides_by_the_originals_medians(init_scale, tmp_path, monkeypatch):
    def random_split(args, pipeline, split):
        generator = torch.Generator().manual_seed(1)
        return TensorDataset(
            torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        )

    monkeypatch.setattr(init_scale.pipelines, "tensors", random_split)
    args = init_scale.parse_args(["--data-dir", str(tmp_path), "--out", str(tmp_path), "--pipelines",
                                  "opacus_cifar10", "--arms", "original,dp", "--seeds", "0,1", "--examples", "4"])  # fmt: skip
    summary = init_scale.run(args)
    original, converted = summary["rows"]
    assert original["arm"] == "original" and original["logit_std_vs_original"] == 1.0
    assert len(original["draws"]) == 2 and original["clip"] == 10.0
    assert abs(converted["params"] - original["params"]) < 0.05 * original["params"]  # mode="dp" keeps the count
    ratio = (converted["draws"][0]["grad_norm_median"] + converted["draws"][1]["grad_norm_median"]) / (
        original["draws"][0]["grad_norm_median"] + original["draws"][1]["grad_norm_median"]
    )  # the median of two draws is their mean
    assert converted["grad_norm_median_vs_original"] == pytest.approx(ratio, rel=2e-3)
