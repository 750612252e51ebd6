"""benchmarks/jpeg_first_encoding.py: the 16x16 test of the JPEG ladder, the distortion ratio, and the carry-over."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.benchmarks.test_jpeg_generations import _image_folder
from tests.support.benchmark_scripts import load_benchmark

REPO_ROOT = Path(__file__).resolve().parents[2]

first = load_benchmark("jpeg_first_encoding")


def test_box_downsample_averages_each_block_and_rounds():
    images = np.zeros((1, 4, 4, 3), dtype=np.uint8)
    images[0, :2, :2] = [[[0, 0, 0], [1, 1, 1]], [[2, 2, 2], [3, 3, 3]]]  # mean 1.5 rounds to 2
    images[0, 2:, 2:] = 200
    small = first.box_downsample(images, 2)
    assert small.shape == (1, 2, 2, 3) and small.dtype == np.uint8
    assert small[0, 0, 0].tolist() == [2, 2, 2]
    assert small[0, 1, 1].tolist() == [200, 200, 200]
    assert small[0, 0, 1].tolist() == [0, 0, 0]


def _textured(count: int, size: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    smooth = np.kron(rng.integers(0, 256, (count, size // 8, size // 8, 3)), np.ones((1, 8, 8, 1)))
    return np.clip(smooth + rng.normal(0, 25, smooth.shape), 0, 255).astype(np.uint8)


def test_the_first_encoding_adds_more_error_than_the_next_generation():
    ratio = first.distortion_ratio(_textured(24, 32))
    assert ratio["images"] == 24
    assert ratio["first_encoding_mse"] > ratio["next_generation_mse"] > 0
    assert ratio["ratio"] == pytest.approx(ratio["first_encoding_mse"] / ratio["next_generation_mse"])
    assert 0 < ratio["ratio_se"] < ratio["ratio"] - 1  # many noisy images: the ratio is clearly above one
    assert set(ratio["ratio_by_channel"]) == {"Y", "Cb", "Cr"}


def test_averaging_leaves_less_error_than_encoding_the_averaged_images():
    residual = first.averaging_residual(_textured(24, 32))
    assert 0 < residual["residual_mse"] < residual["first_encoding_mse"]
    assert set(residual["residual_by_channel"]) == set(residual["first_encoding_by_channel"]) == {"Y", "Cb", "Cr"}


def test_channel_mse_separates_luma_from_chroma_errors():
    base = np.full((2, 8, 8, 3), 100, dtype=np.uint8)
    grey = base + 10  # the same change in R, G and B: luma only
    luma = first.channel_mse(grey, base)
    assert luma[0] == pytest.approx(100.0) and luma[1:] == pytest.approx([0.0, 0.0], abs=1e-9)
    blue = base.copy()
    blue[..., 2] += 10
    chroma = first.channel_mse(blue, base)
    assert chroma == pytest.approx([(0.114 * 10) ** 2, 25.0, (0.081312 * 10) ** 2])


def test_photo_tiles_shrink_each_photograph_and_cut_whole_tiles(tmp_path):
    rng = np.random.default_rng(2)
    Image.fromarray(rng.integers(0, 256, (640, 960, 3), dtype=np.uint8)).save(tmp_path / "wide.png")
    Image.fromarray(rng.integers(0, 256, (100, 100, 3), dtype=np.uint8)).save(tmp_path / "small.png")  # too small
    tiles = first.photo_tiles(tmp_path, 32)
    # short side 640: factor 10 -> 64x96 (2 x 3 tiles), factor 5 -> 128x192 (4 x 6 tiles); the small one none
    assert tiles.shape == (6 + 24, 32, 32, 3) and tiles.dtype == np.uint8
    block = np.asarray(Image.open(tmp_path / "wide.png"))[:10, :10].astype(float).mean(axis=(0, 1))
    assert np.abs(tiles[0, 0, 0].astype(float) - block).max() <= 1  # a box filter: the block's mean


def test_photo_tiles_refuse_a_folder_without_photographs_that_fit(tmp_path):
    with pytest.raises(FileNotFoundError, match="--photos"):
        first.photo_tiles(tmp_path, 32)
    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)).save(tmp_path / "tiny.png")
    with pytest.raises(ValueError, match="256 pixels"):
        first.photo_tiles(tmp_path, 32)


def _runs(accuracies: dict[int, list[float]], **extra) -> list[dict]:
    return [
        {"arm": "private", "generation": g, "seed": seed, "accuracy": acc} | extra
        for g, values in accuracies.items()
        for seed, acc in enumerate(values)
    ]


def test_validation_sets_the_true_cost_against_both_ladder_predictions():
    accuracies = {0: [0.70, 0.72], 1: [0.66, 0.66], 2: [0.65, 0.65], 3: [0.64, 0.64]}
    result = first.validation(_runs(accuracies, epsilon=8.0), [90.0, 50.0, 50.0])
    arm = result["private, epsilon 8"]
    assert arm["true_cost"] == pytest.approx(5.0)
    assert arm["true_cost_se"] == pytest.approx(np.hypot(np.std([70, 72], ddof=1) / np.sqrt(2), 0.0))
    assert arm["predicted_per_generation"] == pytest.approx(1.0)
    assert arm["slope_per_mse"] == pytest.approx(-0.02)
    assert arm["predicted_by_distortion"] == pytest.approx(1.8)  # 0.02 points per MSE x the first encoding's 90


def test_validation_leaves_out_an_arm_without_every_generation():
    runs = _runs({0: [0.7], 1: [0.6]}, epsilon=6.0) + _runs({g: [0.7 - g / 100] for g in range(4)}, epsilon=8.0)
    assert list(first.validation(runs, [90.0, 50.0, 50.0])) == ["private, epsilon 8"]


def test_the_factor_pools_the_private_arms_and_scales_the_ladders_costs():
    arms = {
        "nonprivate": {"true_cost": 9.0, "true_cost_se": 0.1, "predicted_per_generation": 1.0},
        "private, epsilon 8": {"true_cost": 3.0, "true_cost_se": 0.3, "predicted_per_generation": 1.0},
        "private, epsilon 3": {"true_cost": 1.0, "true_cost_se": 0.4, "predicted_per_generation": 1.0},
    }
    for arm in arms.values():
        arm["predicted_per_generation_se"] = 0.2
    factor = first.first_encoding_factor(arms)
    assert factor["factor"] == pytest.approx(2.0) and factor["arms"] == 2  # (3 + 1) / (1 + 1); non-private left out
    assert factor["factor_se"] == pytest.approx(2.0 * np.sqrt(0.25 / 16 + 0.08 / 4))
    carried = first.carried_over(
        {
            "nonprivate": {"cost_of_copy": 5.0, "cost_of_copy_se": 0.1},
            "private, epsilon 8": {"cost_of_copy": 0.8, "cost_of_copy_se": None},
        },
        factor,
    )
    assert list(carried) == ["private, epsilon 8"]
    assert carried["private, epsilon 8"]["estimated_cost"] == pytest.approx(1.6)
    assert carried["private, epsilon 8"]["estimated_cost_se"] is None
    assert first.first_encoding_factor({"nonprivate": arms["nonprivate"]}) is None


def test_tiny_run_trains_the_16x16_ladder_on_the_copy_averaged_2x2(tmp_path, monkeypatch):
    monkeypatch.setenv("EQUICONVERT_CACHE_DIR", str(tmp_path / "cache"))
    _image_folder(tmp_path / "data", per_class=4)
    part = tmp_path / "part.json"
    first.main(
        [
            *("--data-dir", str(tmp_path / "data"), "--tiny", "--generations", "0,1,2,3", "--seeds", "0"),
            *("--device", "cpu", "--workers", "1", "--out", str(part)),
        ]
    )
    summary = json.loads(part.read_text())
    assert {(r["arm"], r["generation"]) for r in summary["runs"]} == {
        (arm, g) for arm in ("nonprivate", "private") for g in range(4)
    }
    assert all(r["images"] == 40 for r in summary["distortion"].values())  # the copy averaged 2x2, every image
    assert len(summary["added_mse_per_generation"]) == 3 and min(summary["added_mse_per_generation"]) > 0
    assert set(summary["validation_percent"]) == {"nonprivate", "private, epsilon 8"}
    assert [row["generation"] for row in summary["rows"]] == [0, 1, 2, 3]


def test_merge_joins_the_parts_and_carries_the_factor_to_the_32x32_ladder(tmp_path):
    accuracies = {0: [0.64, 0.64], 1: [0.60, 0.60], 2: [0.59, 0.59], 3: [0.58, 0.58]}  # true cost 4, ladder 1
    parts = []
    for g, values in accuracies.items():
        part = tmp_path / f"part{g}.json"
        runs = [
            {"arm": "private", "generation": g, "seed": s, "accuracy": a, "epsilon": 8.0} for s, a in enumerate(values)
        ]
        mse = [90.0, 50.0, 50.0][:g]
        part.write_text(
            json.dumps({"command": f"part {g}", "distortion": {}, "runs": runs, "added_mse_per_generation": mse})
        )
        parts.append(str(part))
    distortion = tmp_path / "distortion.json"
    found = {"images": 3, "first_encoding_mse": 2.0, "next_generation_mse": 1.0, "ratio": 2.0, "ratio_se": 0.1}
    distortion.write_text(json.dumps({"command": "d", "distortion": {"photographs, 32x32": found}, "runs": []}))
    ladder = tmp_path / "ladder.json"
    ladder.write_text(
        json.dumps(
            {
                "fit_percent": {"nonprivate": {}, "private, epsilon 8": {"cost_of_copy": 0.8, "cost_of_copy_se": 0.1}},
                "pooled_private_cost_percent": {"cost_of_copy": 0.7, "cost_of_copy_se": 0.1, "arms": ["x"]},
            }
        )
    )
    merged = tmp_path / "merged.json"
    first.main(["--merge", str(distortion), *parts, "--ladder", str(ladder), "--out", str(merged)])
    joined = json.loads(merged.read_text())
    assert len(joined["runs"]) == 8 and joined["added_mse_per_generation"] == [90.0, 50.0, 50.0]
    assert joined["distortion"] == {"photographs, 32x32": found}
    assert joined["first_encoding_factor"]["factor"] == pytest.approx(4.0)
    assert joined["carried_over_percent"]["private, epsilon 8"]["estimated_cost"] == pytest.approx(3.2)
    assert joined["carried_over_percent"][first.POOLED]["estimated_cost"] == pytest.approx(2.8)
    assert joined["command"] == "d ; part 0 ; part 1 ; part 2 ; part 3"


def test_ladder_without_merge_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        first.main(
            ["--data-dir", str(tmp_path), "--ladder", str(tmp_path / "x.json"), "--out", str(tmp_path / "o.json")]
        )


def test_the_paper_tables_jpeg_entries_are_this_benchmarks_one_slope_estimate():
    summaries = REPO_ROOT / "benchmarks" / "results" / "summaries"
    pooled = json.loads((summaries / "jpeg_first_encoding.json").read_text())["carried_over_percent"][first.POOLED]
    table = json.loads((summaries / "cifar10_paper_table.json").read_text())
    checked = set()
    for row in table["rows"]:
        for effect in row.get("explained", []):
            if effect["effect"].startswith("JPEG copy"):
                assert effect["points"] == pytest.approx(-pooled["estimated_cost"], abs=0.005), row["epsilon"]
                assert effect["se"] == pytest.approx(pooled["estimated_cost_se"], abs=0.005), row["epsilon"]
                checked.add(row["epsilon"])
    assert checked == {1, 3, 4, 6, 8, 8.08}  # the released-settings rows (epsilon 8.08) carry it too
