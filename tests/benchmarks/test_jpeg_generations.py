"""benchmarks/jpeg_generations.py: the JPEG-generation ladder, its fits, and a tiny end-to-end run on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from tests.support.benchmark_scripts import load_benchmark
from tests.support.paths import REPO_ROOT

jpeg = load_benchmark("jpeg_generations")


def test_fit_line_extrapolates_a_line_to_one_generation_before_the_copy():
    points = [(k, 80.0 - 1.5 * k) for k in (0, 1, 2, 3) for _ in range(2)]
    fit = jpeg.fit_line(points)
    assert fit["cost_of_copy"] == pytest.approx(1.5)
    assert fit["lossless_estimate"] == pytest.approx(81.5)
    assert fit["slope_se"] == pytest.approx(0.0, abs=1e-9)


def _ladder_runs(slopes: dict[float, float], seeds: int, noise: float, rng: np.random.Generator) -> list[dict]:
    """Private runs at generations 0-3: per epsilon its slope (points per generation), per seed its own offset."""
    return [
        {
            "arm": "private",
            "epsilon": eps,
            "seed": seed,
            "generation": k,
            "accuracy": (60 + 3 * seed + eps + slope * k + noise * rng.standard_normal()) / 100,
        }
        for eps, slope in slopes.items()
        for seed in range(seeds)
        for k in range(4)
    ]


def test_pooled_cost_is_one_least_squares_slope_with_an_intercept_per_arm_and_seed():
    rng = np.random.default_rng(0)
    runs = _ladder_runs({1.0: -0.8, 3.0: -0.8, 8.0: -0.8}, seeds=2, noise=0.3, rng=rng)
    runs.append({"arm": "nonprivate", "seed": 0, "generation": 0, "accuracy": 0.99})  # not a private arm
    pooled = jpeg.pooled_cost(runs)
    private = [r for r in runs if r["arm"] == "private"]
    keys = sorted({(r["epsilon"], r["seed"]) for r in private})
    design = np.array([[float((r["epsilon"], r["seed"]) == key) for key in keys] + [r["generation"]] for r in private])
    y = np.array([100 * r["accuracy"] for r in private])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ coef
    dof = len(y) - design.shape[1]
    se = np.sqrt(residual @ residual / dof * np.linalg.inv(design.T @ design)[-1, -1])
    assert pooled["cost_of_copy"] == pytest.approx(-coef[-1])
    assert pooled["cost_of_copy_se"] == pytest.approx(se)
    assert pooled["arms"] == ["private, epsilon 1", "private, epsilon 3", "private, epsilon 8"]
    assert pooled["arm_seeds"] == 6
    assert pooled["one_slope_per_arm_p"] > 0.05  # one true slope: no evidence against pooling


def test_pooled_cost_flags_arms_whose_slopes_differ_and_needs_two_arms():
    rng = np.random.default_rng(1)
    differing = jpeg.pooled_cost(_ladder_runs({1.0: -3.0, 8.0: 0.0}, seeds=2, noise=0.2, rng=rng))
    assert differing["one_slope_per_arm_p"] < 1e-4
    assert jpeg.pooled_cost(_ladder_runs({3.0: -1.0}, seeds=3, noise=0.2, rng=rng)) is None


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


def test_the_shipped_ladders_one_slope_estimate_is_its_runs_fit():
    summary = json.loads((REPO_ROOT / "benchmarks/results/summaries/jpeg_generations.json").read_text())
    recomputed = jpeg.pooled_cost(summary["runs"])
    shipped = summary["pooled_private_cost_percent"]
    assert shipped["arms"] == recomputed["arms"]
    for key in ("cost_of_copy", "cost_of_copy_se", "one_slope_per_arm_p", "arm_seeds"):
        assert shipped[key] == pytest.approx(recomputed[key]), key
    assert recomputed["arm_seeds"] == 9 and recomputed["one_slope_per_arm_p"] > 0.05
