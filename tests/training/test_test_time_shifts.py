"""Test-time shift averaging: the views, the averaged metrics, and the options that turn it on."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from equiconvert.training.augment import TEST_SHIFTS, shift_set, shifted_views
from equiconvert.training.metrics import classification_metrics, evaluate
from equiconvert.training.trainer import DPTrainer


def reference_shift(images: torch.Tensor, dy: int, dx: int, padding: int) -> torch.Tensor:
    """The image moved by (dy, dx): reflect-pad by `padding`, then crop at (padding + dy, padding + dx)."""
    height, width = images.shape[-2:]
    padded = F.pad(images.double(), (padding,) * 4, mode="reflect").to(images.dtype)
    return padded[..., padding + dy : padding + dy + height, padding + dx : padding + dx + width]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_shifted_views_are_reflect_padded_crops(dtype):
    images = (torch.rand(3, 2, 7, 9) * 255).to(dtype)
    shifts = ((0, 0), (-2, 1), (1, -2), (2, 2))
    views = shifted_views(images, shifts)
    assert views.shape == (3, 4, 2, 7, 9) and views.dtype == dtype
    for index, (dy, dx) in enumerate(shifts):
        assert torch.equal(views[:, index], reference_shift(images, dy, dx, padding=2))
    assert torch.equal(views[:, 0], images)


def test_named_sets_start_with_the_identity_and_unknown_names_are_refused():
    for name, shifts in TEST_SHIFTS.items():
        assert shifts[0] == (0, 0) and len(set(shifts)) == len(shifts) and shift_set(name) == shifts
    assert len(shift_set("cross1")) == 5 and len(shift_set("grid1")) == 9
    with pytest.raises(ValueError, match="unknown test-time shift set 'cross3'.*cross1"):
        shift_set("cross3")
    with pytest.raises(ValueError, match="larger than 3x3"):
        shifted_views(torch.zeros(1, 1, 3, 8), ((3, 0),))
    with pytest.raises(ValueError, match="at least one"):
        shifted_views(torch.zeros(1, 1, 8, 8), ())


def small_classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def test_evaluate_averages_the_softmax_over_the_shifted_images():
    model = small_classifier()
    images, labels = torch.randint(0, 256, (11, 1, 8, 8), dtype=torch.uint8), torch.randint(0, 5, (11,))
    shifts = shift_set("grid1")
    got = evaluate(model, images, labels, batch_size=4, device="cpu", shifts=shifts)
    floats = images.float() / 255
    with torch.no_grad():
        probs = torch.stack([F.softmax(model(reference_shift(floats, dy, dx, 1)).double(), 1) for dy, dx in shifts])
    expected = classification_metrics(probs.mean(0).log(), labels)
    assert got == pytest.approx(expected, abs=1e-9)
    # the identity alone is the plain evaluation
    plain = evaluate(model, images, labels, batch_size=4, device="cpu")
    assert evaluate(model, images, labels, batch_size=4, device="cpu", shifts=((0, 0),)) == pytest.approx(
        plain, abs=1e-6
    )
    assert got["accuracy"] != plain["accuracy"] or got["loss"] != pytest.approx(plain["loss"], abs=1e-6)


def test_trainer_reports_shift_averaged_metrics_of_the_ema_weights_beside_the_plain_ones():
    images, labels = torch.randint(0, 256, (16, 1, 8, 8), dtype=torch.uint8), torch.randint(0, 5, (16,))
    trainer = DPTrainer(
        small_classifier(),
        device="cpu",
        progress=False,
        steps=2,
        batch_size=8,
        aug_mult=1,
        physical_batch_size=8,
        target_epsilon=None,
        noise_multiplier=1.0,
        ema_decay=0.15,
        test_shifts="cross1",
    )
    trainer.fit((images, labels))
    metrics = trainer.evaluate((images, labels))
    with trainer.ema.applied(trainer.model):
        plain = evaluate(trainer.model, images, labels, 1024, "cpu", trainer._normalize)
        averaged = evaluate(trainer.model, images, labels, 1024, "cpu", trainer._normalize, shift_set("cross1"))
    assert metrics == {**plain, **{f"shift_averaged_{k}": v for k, v in averaged.items()}}
    with pytest.raises(ValueError, match="unknown test-time shift set"):
        DPTrainer(small_classifier(), device="cpu", test_shifts="diagonal")


def test_a_run_resumes_with_other_test_shifts_but_not_with_another_schedule(tmp_path):
    """test_shifts only changes what evaluations report, so a checkpoint resumes under another set."""
    images, labels = torch.randint(0, 256, (16, 1, 8, 8), dtype=torch.uint8), torch.randint(0, 5, (16,))
    options = dict(
        device="cpu",
        out_dir=tmp_path,
        progress=False,
        batch_size=8,
        aug_mult=1,
        physical_batch_size=8,
        target_epsilon=None,
        noise_multiplier=1.0,
        ema_decay=None,
        checkpoint_every=1,
    )
    DPTrainer(small_classifier(), steps=1, **options).fit((images, labels))
    resumed = DPTrainer(small_classifier(), steps=1, test_shifts="grid1", **options)
    resumed.fit((images, labels), resume=True)
    assert resumed.step == 1 and "shift_averaged_accuracy" in resumed.evaluate((images, labels))
    with pytest.raises(ValueError, match="different configuration"):
        DPTrainer(small_classifier(), steps=1, lr=1.0, test_shifts="grid1", **options).fit(
            (images, labels), resume=True
        )
