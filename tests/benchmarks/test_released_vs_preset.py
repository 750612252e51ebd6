"""benchmarks/released_vs_preset.py: the released code and our released-settings preset on the same data and schedule.

The released arm runs a tiny stand-in checkout written here (the layout of hlzl/equivariant: networks/, data/
augmentation.py, conf/ and the escnn fork's numerical module), so the adapter, the driver, resuming and the summary
are tested on the CPU without the real checkout; its hydra files are JSON, read by a yaml stand-in (JSON is YAML).
"""

from __future__ import annotations

import json
import sys
from collections import deque
from pathlib import Path

import pytest
import torch

from tests.benchmarks.test_jpeg_generations import _image_folder
from tests.support.benchmark_scripts import load_benchmark

released_vs_preset = load_benchmark("released_vs_preset")  # puts benchmarks/ on the path for its sibling modules
import released_training  # noqa: E402

MODEL = """
from torch import nn


class EquivariantResNet9(nn.Module):
    def __init__(self, num_classes=10, **config):
        super().__init__()
        self.config = config
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        return self.head(self.body(x))
"""
AUGMENTATION = """
import torch


class AugMult:
    def __init__(self, crop_size=32, padding=4, k=4):
        self.k = k - 1

    def de_et_al(self, x):
        return torch.stack([x] + [torch.roll(x, int(torch.randint(-2, 3, ())), dims=-1) for _ in range(self.k)])
"""
CONFIG = {
    "conf/config.yaml": {"hardware": {"deterministic": False, "bs_physical": 8, "num_workers": 0}},
    "conf/setup/eqresnet9-cifar10.yaml": {
        "params": {"aug_mult": 2, "decay": 0.999, "bs": 8192, "update_steps": 2160},
        "dp": {"target_epsilon": 8, "target_delta": 1e-5, "clip_norm": 2},
        "optim": {"optimizer": {"lr": 2}},
        "network": {"layout": [16, 32, 64], "group": "dihedral"},
    },
    "conf/setup/network/resnet9_equivariant.yaml": {
        "group": "dihedral", "rotation": 4, "restrict": "halved", "fix_params": True,
        "layout": [16, 32, 64], "num_groups": [8, 8, 8],
    },
    "conf/setup/optim/sgd.yaml": {"optimizer": {"lr": 2}},
    "conf/setup/dataset/cifar10.yaml": {"image_size": 32},
}  # fmt: skip


@pytest.fixture
def fake_released(tmp_path, monkeypatch) -> Path:
    """A checkout with hlzl/equivariant's layout and a tiny model; `yaml` importable as a JSON reader."""
    root = tmp_path / "released"
    files = {
        "networks/__init__.py": "from .equivariant_resnet9 import EquivariantResNet9\n",
        "networks/equivariant_resnet9.py": MODEL,
        "data/augmentation.py": AUGMENTATION,
        **{f"equivariant/{p}__init__.py": "" for p in ("", "group_theory/", "group_theory/operations/")},
        "equivariant/group_theory/operations/numerical.py": "",
        **{path: json.dumps(value) for path, value in CONFIG.items()},
    }
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "yaml.py").write_text("import json\n\n\ndef safe_load(text):\n    return json.loads(text)\n")
    monkeypatch.syspath_prepend(str(shim))
    monkeypatch.setenv("PYTHONPATH", str(shim))
    monkeypatch.setenv("EQUICONVERT_CACHE_DIR", str(tmp_path / "cache"))
    sys.modules.pop("networks", None)
    return root


def test_the_released_step_clips_each_view_sum_adds_noise_once_and_divides_by_bs():
    """Two examples, one physical batch each: the update is lr (clipped sum + sigma C noise) / bs, the EMA updated
    after each physical batch with torch_ema's warm-up."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    views = torch.randn(2, 2, 3)
    labels = torch.tensor([0, 1])
    s = released_training.ReleasedSettings(
        steps=1, batch_size=4, aug_mult=2, max_grad_norm=0.01, lr=0.5, ema_decay=0.999, physical_batch_size=1,
        noise_multiplier=1.0, delta=1e-5, normalize_mean=(0.0,) * 3, normalize_std=(1.0,) * 3,
    )  # fmt: skip
    ema = released_training.ParameterEMA(model, s.ema_decay)
    noise = torch.Generator().manual_seed(5)
    parts = [(views[:1], labels[:1]), (views[1:], labels[1:])]  # physical batches of one example
    released_training.released_step(model, ema, parts, s, noise, torch.device("cpu"))

    expected = {n: torch.zeros_like(p) for n, p in start.items()}
    for i in range(2):
        model_i = torch.nn.Linear(3, 2)
        model_i.load_state_dict(start)
        torch.nn.functional.cross_entropy(model_i(views[i]), labels[i].repeat(2), reduction="sum").backward()
        grads = {n: p.grad for n, p in model_i.named_parameters()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        assert norm > s.max_grad_norm  # clipping is exercised
        for name, g in grads.items():
            expected[name] += g * (s.max_grad_norm / (norm + 1e-6))
    draws = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        noisy = expected[name] + s.noise_multiplier * s.max_grad_norm * torch.randn(param.shape, generator=draws)
        torch.testing.assert_close(param.detach(), start[name] - s.lr * noisy / s.batch_size)
    assert ema.updates == 2  # one per physical batch; the first (decay 2/11) before the step, the second after
    for name, param in model.named_parameters():  # the first update averages the start with itself
        torch.testing.assert_close(ema.shadow[name], start[name] * 3 / 12 + param.detach() * (1 - 3 / 12))


def test_logical_batches_are_poisson_draws_cut_into_near_equal_physical_batches():
    s = released_training.ReleasedSettings(
        steps=40, batch_size=25, aug_mult=2, max_grad_norm=1.0, lr=1.0, ema_decay=0.999, physical_batch_size=3,
        noise_multiplier=1.0, delta=1e-5, normalize_mean=(0.0,) * 3, normalize_std=(1.0,) * 3,
    )  # fmt: skip
    assert s.sample_rate(110) == 1 / 4  # one over the full batches of 25 in 110 examples
    counts: deque[int] = deque()
    parts = list(released_training.physical_batches(110, s, 40, torch.Generator().manual_seed(0), counts))
    assert len(counts) == 40 and sum(counts) == len(parts)
    sizes = [len(p) for p in parts]
    for count in counts:
        step, sizes = sizes[:count], sizes[count:]
        assert count == max(1, -(-sum(step) // 3)) and max(step) - min(step) <= 1 and max(step) <= 3
    drawn = [i for p in parts for i in p]
    assert 0.2 < len(drawn) / (40 * 110) < 0.3  # rate 1/4
    empty = released_training.ReleasedSettings(**{**s.__dict__, "batch_size": 1})
    nothing = list(released_training.physical_batches(2, empty, 1, torch.Generator().manual_seed(4), deque()))
    assert nothing == [[]]  # seed 4 draws no example at rate 1/2: one empty physical batch, the step noise alone
    assert released_training._stacked([]) is None


def test_tiny_run_trains_both_arms_resumes_and_writes_the_comparison(tmp_path, fake_released):
    _image_folder(tmp_path / "data", per_class=4)
    runs, out = tmp_path / "runs", tmp_path / "out"
    argv = [
        *("--released", str(fake_released), "--data-dir", str(tmp_path / "data" / "cifar10"), "--device", "cpu"),
        *("--seeds", "0", "--steps", "2", "--batch-size", "10", "--jobs", "2", "--checkpoint-every", "1"),
        *("--runs", str(runs), "--out", str(out), "--preset-set", "model.kwargs.layout=[8, 8, 8]"),
        *("--preset-set", "dp.physical_batch_size=8", "--loader-workers", "1"),
    ]
    assert released_vs_preset.main(argv) == 0
    summary = json.loads((out / "released_vs_preset.json").read_text())
    assert summary["kind"] == "released_vs_preset" and summary["runs_without_result"] == []
    assert {(r["arm"], r["seed"]) for r in summary["rows"]} == {("released", 0), ("preset", 0)}
    for row in summary["rows"]:
        assert row["steps"] == 2 and row["stopped_reason"] is None
        assert 0 <= row["test_accuracy"] <= 100 and row["wall_time_s"] > 0
    epsilons = {r["arm"]: r["epsilon"] for r in summary["rows"]}
    assert epsilons["released"] == pytest.approx(epsilons["preset"], rel=1e-3)  # same sigma, rate and steps
    assert summary["settings"]["max_grad_norm"] == 2 and summary["settings"]["physical_batch_size"] == 4
    assert summary["arms"]["released"]["n"] == 1 and summary["released_minus_preset"] is None  # one seed: no SE

    preset_run = json.loads((runs / "preset_seed0" / "result.json").read_text())
    assert preset_run["max_grad_norm"] == pytest.approx(1.0)  # C / K: the mean of the views
    assert preset_run["lr"] == pytest.approx(2 * 2 * 10 / 10)  # lr x K x expected batch / bs
    assert preset_run["noise_multiplier"] == pytest.approx(summary["settings"]["noise_multiplier"])

    # a stopped released run resumes from its checkpoint: make seed 0 look unfinished at step 1
    checkpoint = runs / "released_seed0" / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=True)
    assert oct(checkpoint.stat().st_mode & 0o777) == "0o600"
    state["step"] = 1
    torch.save(state, checkpoint)
    result = json.loads((runs / "released_seed0" / "result.json").read_text())
    (runs / "released_seed0" / "result.json").write_text(json.dumps({**result, "stopped_reason": "time_limit"}))
    assert released_vs_preset.main(argv) == 0
    log = (runs / "released_seed0" / "stdout.log").read_text()
    assert log.count("=== ") == 2  # started once, resumed once; the finished runs were not run again
    assert (runs / "preset_seed0" / "stdout.log").read_text().count("=== ") == 1


def test_an_unknown_arm_is_refused_naming_the_flag(tmp_path, fake_released):
    with pytest.raises(released_vs_preset.UsageError, match="--arms"):
        released_vs_preset.main(["--released", str(fake_released), "--data-dir", str(tmp_path), "--arms", "theirs"])


def test_without_a_checkout_the_error_says_how_to_give_one(tmp_path, monkeypatch):
    monkeypatch.delenv(released_vs_preset.ENV_VAR, raising=False)
    with pytest.raises(released_vs_preset.EquiconvertError, match="--released DIR"):
        released_vs_preset.main(["--data-dir", str(tmp_path)])


def test_the_comparison_counts_finished_runs_and_gives_the_difference_its_standard_error():
    rows = (
        [{"arm": "released", "test_accuracy": a, "stopped_reason": None} for a in (80.0, 82.0)]
        + [{"arm": "preset", "test_accuracy": a, "stopped_reason": None} for a in (78.0, 79.0, 80.0)]
        + [
            {"arm": "preset", "test_accuracy": 10.0, "stopped_reason": "time_limit"}  # unfinished: not counted
        ]
    )
    compared = released_vs_preset.compare(rows)
    assert compared["arms"]["preset"]["n"] == 3 and compared["arms"]["preset"]["mean"] == pytest.approx(79.0)
    difference = compared["released_minus_preset"]
    assert difference["points"] == pytest.approx(2.0)
    assert difference["se"] == pytest.approx((2.0 / 2 + 1.0 / 3) ** 0.5)  # sqrt(s1^2/n1 + s2^2/n2)
    assert difference["in_se"] == pytest.approx(2.0 / difference["se"])
