"""benchmarks/jpeg_generations.py: the JPEG-generation ladder, its fits, and a tiny end-to-end run on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from tests.support.benchmark_scripts import load_benchmark

jpeg = load_benchmark("jpeg_generations")


def test_fit_line_extrapolates_a_line_to_one_generation_before_the_copy():
    points = [(k, 80.0 - 1.5 * k) for k in (0, 1, 2, 3) for _ in range(2)]
    fit = jpeg.fit_line(points)
    assert fit["cost_of_copy"] == pytest.approx(1.5)
    assert fit["lossless_estimate"] == pytest.approx(81.5)
    assert fit["slope_se"] == pytest.approx(0.0, abs=1e-9)


def test_pooled_cost_weights_each_arm_by_its_inverse_variance_and_leaves_out_arms_without_one():
    fits = {
        "private, epsilon 3": {"cost_of_copy": 1.0, "cost_of_copy_se": 0.1},
        "private, epsilon 8": {"cost_of_copy": 2.0, "cost_of_copy_se": 0.2},
        "private, epsilon 1": {"cost_of_copy": 9.0, "cost_of_copy_se": None},
    }
    pooled = jpeg.pooled_cost(fits)
    assert pooled["cost_of_copy"] == pytest.approx((100 * 1.0 + 25 * 2.0) / 125)
    assert pooled["cost_of_copy_se"] == pytest.approx(125**-0.5)
    assert pooled["arms"] == ["private, epsilon 3", "private, epsilon 8"]
    assert jpeg.pooled_cost({"private, epsilon 1": fits["private, epsilon 1"]}) is None


def test_a_line_through_two_points_has_no_standard_error():
    fit = jpeg.fit_line([(0, 70.0), (1, 68.0)])
    assert fit["cost_of_copy"] == pytest.approx(2.0)
    assert fit["slope_se"] is None and fit["lossless_estimate_se"] is None
    assert jpeg.mse_based_cost([(0, 70.0), (1, 68.0)], [50.0])["cost_of_copy_lower_bound_se"] is None


def test_distortion_based_cost_scales_the_accuracy_slope_by_the_first_generations_error():
    added = [50.0, 40.0, 30.0]
    cumulative = [0.0, 50.0, 90.0, 120.0]
    points = [(k, 80.0 - 0.02 * cumulative[k]) for k in range(4)]
    cost = jpeg.mse_based_cost(points, added)
    assert cost["slope_per_mse"] == pytest.approx(-0.02)
    assert cost["cost_of_copy_lower_bound"] == pytest.approx(1.0)


def test_a_generation_loses_detail_and_keeps_the_image_in_place():
    rng = np.random.default_rng(0)
    smooth = np.kron(rng.integers(0, 256, (4, 4, 4, 3)), np.ones((1, 8, 8, 1))).astype(np.uint8)
    noisy = np.clip(smooth + rng.normal(0, 20, smooth.shape), 0, 255).astype(np.uint8)
    once = jpeg.one_generation(noisy, (4, 4))
    assert once.shape == noisy.shape and once.dtype == np.uint8
    error = np.abs(once.astype(float) - noisy.astype(float)).mean()
    assert 0 < error < 30  # detail is lost, but the image is not shifted (a 4-pixel shift would cost far more)
    assert np.array_equal(jpeg.one_generation(noisy, (4, 4)), once)


def _image_folder(root, per_class: int) -> None:
    rng = np.random.default_rng(1)
    for split, count in (("train", per_class), ("test", max(2, per_class // 2))):
        for label in range(10):
            folder = root / "cifar10" / split / f"class{label}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = np.clip(rng.normal(25 * label, 30, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=75)


def test_tiny_run_trains_both_arms_on_each_generation_and_writes_the_fits(tmp_path, monkeypatch):
    monkeypatch.setenv("EQUICONVERT_CACHE_DIR", str(tmp_path / "cache"))
    _image_folder(tmp_path / "data", per_class=4)
    out = tmp_path / "summary.json"
    jpeg.main(
        [
            *("--data-dir", str(tmp_path / "data"), "--tiny", "--generations", "0,1", "--seeds", "0"),
            *("--epsilons", "8,3", "--device", "cpu", "--workers", "1", "--out", str(out)),
        ]
    )
    summary = json.loads(out.read_text())
    assert {(r["arm"], r.get("epsilon"), r["generation"]) for r in summary["runs"]} == {
        (arm, eps, g) for arm, eps in (("nonprivate", None), ("private", 8.0), ("private", 3.0)) for g in (0, 1)
    }
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in summary["runs"])
    assert len(summary["added_mse_per_generation"]["train"]) == 1
    assert summary["added_mse_per_generation"]["train"][0] > 0
    assert set(summary["fit_percent"]) == {"nonprivate", "private, epsilon 8", "private, epsilon 3"}
    merged = tmp_path / "merged.json"
    jpeg.main(["--merge", str(out), str(out), "--out", str(merged)])
    assert len(json.loads(merged.read_text())["runs"]) == 2 * len(summary["runs"])


def test_merge_reads_a_one_epsilon_summary_as_that_epsilons_private_arm(tmp_path):
    run = {"generation": 0, "seed": 0, "accuracy": 0.7}
    single = {
        "command": "a",
        "added_mse_per_generation": {"train": [50.0], "test": [50.0]},
        "private": {"target_epsilon": 8.0, "steps": 300},
        "runs": [run | {"arm": "private"}, run | {"arm": "private", "generation": 1, "accuracy": 0.69}],
    }
    several = single | {
        "command": "b",
        "private": {"steps": 300, "epsilons": [3.0]},
        "runs": [run | {"arm": "private", "epsilon": 3.0}, run | {"arm": "private", "epsilon": 3.0, "generation": 1}],
    }
    parts = [tmp_path / "single.json", tmp_path / "several.json"]
    for path, part in zip(parts, (single, several)):
        path.write_text(json.dumps(part))
    jpeg.merge([str(p) for p in parts], str(tmp_path / "merged.json"))
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["private"] == {"steps": 300, "epsilons": [3.0, 8.0]}
    assert merged["fit_percent"]["private, epsilon 8"]["cost_of_copy"] == pytest.approx(1.0)
    assert merged["fit_percent"]["private, epsilon 3"]["cost_of_copy"] == pytest.approx(0.0, abs=1e-9)
