"""equiconvert's own Fashion-MNIST pipeline (the recipe `cpu_main_job`): a ResNet9 of widths 8/16/32 at epsilon 3,
its settings run through make_private."""

from __future__ import annotations

from torch import nn

from equiconvert.models import resnet9

from .base import UNIT_RANGE, Pipeline, group_norm_width, register, sgd


def small_resnet9(width: float = 1.0, num_classes: int = 10) -> nn.Module:
    return resnet9(
        num_classes=num_classes, in_channels=1, widths=tuple(group_norm_width(c, width) for c in (8, 16, 32))
    )


register(
    Pipeline(
        name="equiconvert_fmnist",
        source="equiconvert recipe cpu_main_job (equiconvert/recipes/files/cpu_main_job.toml)",
        published="79-80% at epsilon 3 (delta 1e-6) for the D4 conversion with DPTrainer and EMA (docs/results.md)",
        translated="make_private in place of DPTrainer, no EMA; 28x28 padded to 32x32 as the recipe pads",
        dataset="fashion-mnist",
        build=small_resnet9,
        optimizer=sgd(0.5, momentum=0.9),
        batch_size=256,
        epochs=2,
        epsilon=3.0,
        delta=1e-6,
        max_grad_norm=2.0,
        normalize=UNIT_RANGE,
        input_size=32,
        physical_batch_size=256,
    )
)
