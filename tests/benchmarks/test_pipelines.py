"""benchmarks/pipelines.py: the gallery's pipelines build, widen to a parameter count, and train a run to JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.utils.data import TensorDataset

from tests.support.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def gallery():
    return load_benchmark("pipelines")


@pytest.fixture
def small_opacus_pipeline(gallery, monkeypatch):
    """Opacus' CIFAR-10 pipeline on 64 random training images (32 test) at an expected batch of 16."""

    def random_split(args, pipeline, split):
        generator = torch.Generator().manual_seed(0 if split == "train" else 1)
        n = 64 if split == "train" else 32
        return TensorDataset(
            torch.randn(n, 3, 32, 32, generator=generator), torch.randint(0, 10, (n,), generator=generator)
        )

    monkeypatch.setattr(gallery, "tensors", random_split)
    pipeline = dataclasses.replace(gallery.PIPELINES["opacus_cifar10"], batch_size=16, physical_batch_size=8)
    monkeypatch.setitem(gallery.PIPELINES, "opacus_cifar10", pipeline)  # a sampling rate of 1/4 on 64 examples


def test_every_pipeline_names_its_source_and_builds_wider_when_asked(gallery):
    from pipeline_gallery.arms import parameter_count

    assert {"opacus_cifar10", "tramer_boneh_cifar10", "resnet9_scalenorm_cifar10"} <= set(gallery.PIPELINES)
    for name in gallery.PIPELINES:
        pipeline = gallery.PIPELINES[name]
        assert pipeline.source and pipeline.published and pipeline.translated
        assert parameter_count(pipeline.build(1.5)) > parameter_count(pipeline.build(1.0))


def test_the_widened_control_matches_a_parameter_count(gallery):
    from pipeline_gallery.arms import parameter_count, widened

    pipeline = gallery.PIPELINES["opacus_cifar10"]
    assert parameter_count(pipeline.build(1.0)) == 131_466  # Opacus' convnet as published
    model, multiplier = widened(pipeline, 293_000)
    assert multiplier > 1.3 and abs(parameter_count(model) - 293_000) < 0.02 * 293_000


def test_a_run_trains_privately_with_the_pipelines_settings_and_writes_its_record(
    gallery, small_opacus_pipeline, tmp_path
):
    args = gallery.parse_args(
        ["--data-dir", str(tmp_path), "--out", str(tmp_path), "--device", "cpu", "--epochs", "1", "--lr-scale", "0.5"]
    )
    progress = tmp_path / "run.progress"
    result = gallery.run_one(args, "opacus_cifar10", "original", 0, progress)
    assert result["params"] == result["params_original"] == 131_466
    assert result["steps"] == 4 and 0 < result["epsilon"] <= 8.0 + 1e-6  # four Poisson steps in the epoch
    assert 0.0 <= result["test_accuracy"] <= 100.0
    assert result["lr"] == pytest.approx(0.05)  # the pipeline's 0.1, scaled; runs at another scale go elsewhere
    assert gallery.result_path(args, "opacus_cifar10", "original", 0).parent.name == "original_lr_x0.5_ep1"
    assert json.loads(progress.read_text())["epoch"] == 1


def test_an_unknown_pipeline_is_refused_naming_the_flag(gallery, tmp_path):
    with pytest.raises(SystemExit, match="--pipelines: unknown"):
        gallery.run_all(
            gallery.parse_args(["--data-dir", str(tmp_path), "--out", str(tmp_path), "--pipelines", "nope"])
        )


def test_a_run_stopped_after_an_epoch_goes_on_from_its_checkpoint(
    gallery, small_opacus_pipeline, tmp_path, monkeypatch
):
    args = gallery.parse_args(["--data-dir", str(tmp_path), "--out", str(tmp_path), "--device", "cpu", "--epochs", "3"])
    fresh = gallery.run_one(args, "opacus_cifar10", "original", 0, tmp_path / "fresh.progress")

    evaluate, calls = gallery.accuracy, []

    def killed_at_the_second_evaluation(*a):
        calls.append(1)
        if len(calls) == 2:  # during epoch 2: epoch 1 is checkpointed, epoch 2 is not
            raise KeyboardInterrupt
        return evaluate(*a)

    monkeypatch.setattr(gallery, "accuracy", killed_at_the_second_evaluation)
    progress = tmp_path / "run.progress"
    with pytest.raises(KeyboardInterrupt):
        gallery.run_one(args, "opacus_cifar10", "original", 0, progress)
    assert json.loads(progress.read_text())["epoch"] == 1 and gallery.checkpoint_path(progress).exists()
    monkeypatch.setattr(gallery, "accuracy", evaluate)
    resumed = gallery.run_one(args, "opacus_cifar10", "original", 0, progress)
    assert resumed["steps"] == fresh["steps"] == 12  # 4 restored, 8 more: epoch 2 is run again, not counted twice
    assert resumed["epsilon"] == pytest.approx(fresh["epsilon"], rel=1e-9)  # the accountant's history restored
    assert [point["epoch"] for point in resumed["curve"]] == [1, 2]
