"""bf16 autocast (precision="bf16"): the same computation as autocast's own backward, per example, in fp32."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import equiconvert
from equiconvert.cli import main
from equiconvert.models import equivariant_resnet9, resnet9
from equiconvert.privacy.bookkeeping import BookkeepingUnsupportedError, per_sample_gradients_bookkeeping
from equiconvert.privacy.checkpoint import load, save_atomic
from equiconvert.privacy.dp_step import clip_and_sum, per_sample_norms
from equiconvert.training.trainer import DPTrainer
from tests.support.train_args import tiny_train_args

MAX_GRAD_NORM = 0.01  # below every example's norm here: every example is clipped


def _views_and_labels(batch=4, views=2, size=32):
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randn(batch, views, 3, size, size, generator=generator),
        torch.randint(0, 10, (batch,), generator=generator),
    )


def _autocast_gradient(model, views, labels):
    """The gradient autocast's own backward gives for the sum over examples of their mean loss over views."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(views.flatten(0, 1))
    per_view = F.cross_entropy(logits.float(), labels.repeat_interleave(views.shape[1]), reduction="none")
    per_view.reshape(views.shape[:2]).mean(1).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "make",
    [
        lambda: equivariant_resnet9("D4"),
        lambda: equiconvert.make_equivariant(resnet9(widths=(8, 16, 32)), "C4", head="invariant"),
    ],
    ids=["paper D4", "resnet9 C4"],
)
def test_bf16_per_example_gradients_sum_to_autocasts_gradient_and_are_fp32(make):
    torch.manual_seed(0)
    model = make().train()
    views, labels = _views_and_labels()
    grads, losses = per_sample_gradients_bookkeeping(model, views, labels, autocast_dtype=torch.bfloat16)
    expected = _autocast_gradient(model, views, labels)
    assert all(g.dtype == torch.float32 for g in grads.values()) and losses.dtype == torch.float32
    for name, value in expected.items():
        error = float((grads[name].sum(0) - value).norm() / value.norm())
        assert error < 2e-2, (name, error)  # bf16 rounding of the per-example products, not another gradient
    clipped, norms = clip_and_sum(grads, MAX_GRAD_NORM)
    assert bool((norms > MAX_GRAD_NORM).all())
    # every example contributes at most C: the sum of clipped gradients has norm <= B * C
    assert float(per_sample_norms({n: v.unsqueeze(0) for n, v in clipped.items()})) <= len(labels) * MAX_GRAD_NORM * (
        1 + 1e-6
    )


def _model():
    return equiconvert.make_equivariant(resnet9(widths=(8, 8, 8), num_classes=4), "C4", head="invariant")


def _data(n=32):
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 16, 16), dtype=torch.uint8, generator=generator), torch.arange(n) % 4


OPTIONS = dict(
    target_epsilon=8.0,
    batch_size=8,
    steps=2,
    aug_mult=2,
    lr=0.5,
    progress=False,
    device="cpu",
    physical_batch_size=8,
    insecure_seeded_noise=True,
)  # runs are compared: the same noise in each


def test_a_bf16_run_takes_the_fp32_runs_steps_up_to_rounding():
    torch.manual_seed(0)
    model = _model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    runs = {}
    for precision in ("fp32", "bf16"):
        trainer = DPTrainer(copy.deepcopy(model), precision=precision, **OPTIONS)
        trainer.fit(_data())
        runs[precision] = {n: p.detach() for n, p in trainer.model.named_parameters()}
    moved = torch.cat([(runs["fp32"][n] - initial[n]).flatten() for n in initial]).norm()
    apart = torch.cat([(runs["bf16"][n] - runs["fp32"][n]).flatten() for n in initial]).norm()
    # same batches, same noise: the same two steps, up to bf16 rounding (which is there: bf16 did run)
    assert float(moved) > 0 and 0 < float(apart / moved) < 0.05


def test_bf16_needs_bookkeeping():
    with pytest.raises(
        ValueError,
        match="no per-example gradient back-end for per_sample_method 'vmap' with precision 'bf16'.*'vmap', 'fp32'",
    ):
        DPTrainer(_model(), precision="bf16", per_sample_method="vmap", **OPTIONS)
    with pytest.raises(ValueError, match="precision must be one of"):
        DPTrainer(_model(), precision="fp16", **OPTIONS)

    class Twice(torch.nn.Module):  # one conv applied twice: book-keeping cannot run it, vmap could, in fp32
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
            self.head = torch.nn.Linear(3, 4)

        def forward(self, x):
            return self.head(self.conv(self.conv(x)).mean((2, 3)))

    class Tied(torch.nn.Module):  # one weight in two layers: refused by book-keeping's static check
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
            self.second.weight = self.first.weight

        def forward(self, x):
            return self.second(self.first(self.conv(x).mean((2, 3))))

    assert DPTrainer(Tied(), **OPTIONS).per_sample_method == "vmap"  # fp32: "auto" falls back
    with pytest.raises(BookkeepingUnsupportedError, match="needs per_sample_method 'bookkeeping'.*parameter shared"):
        DPTrainer(Tied(), precision="bf16", **OPTIONS)
    with pytest.warns(UserWarning, match="using vmap"):  # fp32: "auto" falls back, as before
        DPTrainer(Twice(), **OPTIONS).fit(_data())
    with pytest.raises(BookkeepingUnsupportedError, match="needs per_sample_method 'bookkeeping'.*runs more than once"):
        DPTrainer(Twice(), precision="bf16", **OPTIONS).fit(_data())


def test_checkpoints_from_before_the_precision_option_resume_and_precision_is_part_of_the_run(tmp_path):
    model = _model()
    first = DPTrainer(copy.deepcopy(model), out_dir=tmp_path, **OPTIONS)
    first.fit(_data(), time_limit_s=0.0)
    state = load(first.checkpoint_path())
    del state["config"]["precision"]  # as written by a version without the option (fp32)
    save_atomic(state, first.checkpoint_path())
    with pytest.raises(ValueError, match="'precision': \\('fp32', 'bf16'\\)"):
        DPTrainer(copy.deepcopy(model), out_dir=tmp_path, precision="bf16", **OPTIONS).fit(_data(), resume=True)
    resumed = DPTrainer(copy.deepcopy(model), out_dir=tmp_path, **OPTIONS)
    resumed.fit(_data(), resume=True)
    assert resumed.step == 2


def test_train_precision_reaches_the_trainer_and_the_result(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        tiny_train_args(
            out,
            "--set",
            "dp.precision=bf16",
            model="equiconvert:resnet9",
            model_kwargs="widths=8,16,32",
            group="C4",
            epsilon=8,
        )
    )
    assert code == 0
    result = json.loads((out / "result.json").read_text())
    assert result["precision"] == "bf16" and result["per_sample_method"] == "bookkeeping"
    capsys.readouterr()
