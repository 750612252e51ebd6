"""benchmarks/pretrained_adaptation.py --tiny: pretraining, four private fine-tunings at one budget, JSON summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.benchmark_scripts import load_benchmark

FASHION = Path("/usr/share/datasets/fashion-mnist")
MNIST = Path("/work/shared/data/mnist-10k.npz")


@pytest.mark.slow  # about a minute on two CPU cores: mostly DP-SGD's probes and the accountant
@pytest.mark.skipif(not (FASHION.is_dir() and MNIST.is_file()), reason=f"needs Fashion-MNIST in {FASHION} and {MNIST}")
@pytest.mark.parametrize("task", ["digits", "fashion_split"])
def test_tiny_run_fine_tunes_four_models_privately_and_the_carried_and_canonicalised_ones_are_invariant(tmp_path, task):
    out = tmp_path / "summary.json"
    args = ["--tiny", "--task", task, "--group", "D4", "--fashion-dir", str(FASHION), "--mnist", str(MNIST)]
    args += ["--out", str(out)]
    assert load_benchmark("pretrained_adaptation").main(args) == 0
    summary = json.loads(out.read_text())
    assert summary["tiny"] and summary["group"] == "D4" and summary["epsilons"] == [3.0] and summary["task"] == task
    (run,) = summary["runs"]
    assert run["noise_multiplier"] > 0 and run["seed"] == 0
    results = run["results"]
    assert set(results) == {"scratch_converted", "pretrained", "pretrained_carried", "pretrained_canonicalized"}
    for name, result in results.items():
        assert result["steps"] == 2 and 0 < result["epsilon"] <= run["target_epsilon"], name
        assert 0 <= result["upright_accuracy"] <= 1 and 0 <= result["turned_accuracy"] <= 1, name
    # the invariant models score the turned digits exactly as the upright ones
    for name in ("scratch_converted", "pretrained_carried", "pretrained_canonicalized"):
        assert results[name]["turned_accuracy"] == results[name]["upright_accuracy"], name
    assert results["pretrained_canonicalized"]["parameters"] > results["pretrained"]["parameters"]
    carried = results["pretrained_carried"]  # started near the group-averaged pretrained CNN (GroupNorms: not exactly)
    assert 0 < carried["carry_logit_error"] < 0.1 * carried["carry_logit_scale"]
    assert 0 <= carried["upright_accuracy_before_fine_tuning"] <= 1
    assert carried["multiply_adds"] > 8 * carried["pretrained_multiply_adds"]  # D4: |G|^2 = 64 on hidden layers
    # the table holds one median row per model, here of the one seed's accuracies
    rows = {row["model"]: row for row in summary["table"]}
    assert set(rows) == set(results)
    for name, row in rows.items():
        assert row["upright_accuracy"] == results[name]["upright_accuracy"] and row["seeds"] == [0], name


@pytest.mark.skipif(not FASHION.is_dir(), reason=f"needs Fashion-MNIST in {FASHION}")
def test_fashion_split_keeps_the_public_and_the_private_classes_apart():
    module = load_benchmark("pretrained_adaptation")
    public, public_test, private, private_test = module.fashion_split_task(
        module.parse_args(["--fashion-dir", str(FASHION)])
    )
    assert set(public[1].tolist()) == set(public_test[1].tolist()) == {0, 1, 2, 3, 4}
    assert set(private[1].tolist()) == set(private_test[1].tolist()) == {5, 6, 7, 8, 9}
    assert len(public[1]) == len(private[1]) == 30_000 and len(private_test[1]) == 5_000


@pytest.mark.skipif(not FASHION.is_dir(), reason=f"needs Fashion-MNIST in {FASHION}")
def test_arms_run_alone_and_merge_adds_them_to_the_summarys_runs(tmp_path):
    module = load_benchmark("pretrained_adaptation")
    out = tmp_path / "summary.json"
    common = ["--tiny", "--fashion-dir", str(FASHION), "--seeds", "0", "--out", str(out)]
    assert module.main([*common, "--arms", "pretrained"]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert set(run["results"]) == {"pretrained"}  # no other model was built or trained
    assert module.main([*common, "--arms", "scratch_converted", "--merge"]) == 0
    summary = json.loads(out.read_text())
    (run,) = summary["runs"]
    assert set(run["results"]) == {"pretrained", "scratch_converted"}
    assert [row["model"] for row in summary["table"]] == ["scratch_converted", "pretrained"]
    # without --merge the summary holds this invocation's runs only
    assert module.main([*common, "--arms", "pretrained"]) == 0
    assert set(json.loads(out.read_text())["runs"][0]["results"]) == {"pretrained"}
    with pytest.raises(SystemExit, match="another task, group, size or fine-tuning"):
        module.main([*common, "--arms", "pretrained", "--merge", "--lr", "0.5"])


def test_unknown_arms_and_merge_without_out_are_refused_before_any_work(capsys):
    module = load_benchmark("pretrained_adaptation")
    with pytest.raises(SystemExit):
        module.parse_args(["--arms", "pretrained,carried"])
    assert "--arms: unknown ['carried']; choose from ['scratch_converted'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        module.parse_args(["--merge"])
    assert "--merge needs --out" in capsys.readouterr().err


def test_pose_breakdown_splits_the_upright_accuracy_by_the_pose_the_canonicaliser_picks():
    module = load_benchmark("pretrained_adaptation")
    torch.manual_seed(0)
    model = module.canonicalize(module.SmallCNN(), "C4", in_channels=1, fields=2, kernel_size=5, pool=2)
    images = torch.randint(0, 256, (64, 1, 28, 28), dtype=torch.uint8)
    labels = torch.randint(0, 10, (64,))
    breakdown = module.pose_breakdown(model, images, labels)
    share = breakdown["upright_identity_pose_share"]
    assert 0 < share < 1  # an untaught canonicaliser turns some of the images and keeps others
    overall = module.accuracy(model, images, labels)
    split = (
        share * breakdown["upright_accuracy_identity_posed"] + (1 - share) * breakdown["upright_accuracy_turned_posed"]
    )
    assert split == pytest.approx(overall, abs=1e-6)
    # on the images kept in the identity pose the wrapped model is its backbone
    kept = torch.tensor([pose == "rot0" for pose in model.poses(module._normalised(images))])
    with torch.no_grad():
        backbone = model.backbone(module._normalised(images)).argmax(-1)
    assert breakdown["backbone_upright_accuracy"] == pytest.approx(float((backbone == labels).float().mean()))
    assert breakdown["upright_accuracy_identity_posed"] == pytest.approx(
        float((backbone[kept] == labels[kept]).float().mean())
    )


@pytest.mark.skipif(not FASHION.is_dir(), reason=f"needs Fashion-MNIST in {FASHION}")
def test_pretrain_only_writes_each_seeds_weights_as_the_recipes_load_them(tmp_path):
    """--pretrain-only: the state dict of each seed's pretrained CNN, loadable into create_model("small_cnn")."""
    from equiconvert.models import create_model

    module = load_benchmark("pretrained_adaptation")
    args = ["--tiny", "--task", "fashion_split", "--fashion-dir", str(FASHION), "--seeds", "0,1"]
    assert module.main([*args, "--pretrain-only", str(tmp_path)]) == 0
    states = [torch.load(tmp_path / f"fashion_split_seed{seed}.pt", weights_only=True) for seed in (0, 1)]
    model = create_model("small_cnn")
    for state in states:
        model.load_state_dict(state)  # every name and shape of the registry's model
    # the seed's own pretraining: run_cell pretrains the same CNN from the same seed
    parsed = module.parse_args(args)
    public = module.fashion_split_task(parsed)[0]
    again = module.pretrain(*module.subset(*public, parsed.sizes["pretrain_examples"], 1), 3, 128, 1, "cpu")
    assert all(torch.equal(again.state_dict()[name], value) for name, value in states[1].items())
    assert not torch.equal(states[0]["head.weight"], states[1]["head.weight"])
