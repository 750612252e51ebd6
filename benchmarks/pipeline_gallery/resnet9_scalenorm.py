"""Klause et al. (2022), "Differentially private training of residual networks with scale normalisation": the
ResNet-9 with GroupNorm, Mish and ScaleNorm (equiconvert.models.resnet9 builds it with their parameter count,
2,448,714)."""

from __future__ import annotations

from torch import nn

from equiconvert.models import resnet9

from .base import CIFAR10_MEAN_STD, Pipeline, group_norm_width, register, sgd


def scalenorm_resnet9(width: float = 1.0, num_classes: int = 10) -> nn.Module:
    return resnet9(num_classes=num_classes, widths=tuple(group_norm_width(c, width) for c in (64, 128, 256)))


register(
    Pipeline(
        name="resnet9_scalenorm_cifar10",
        source="Klause, Ziller, Rueckert, Hammernik, Kaissis, arXiv:2203.00324 (2022)",
        published="82.5% on CIFAR-10 at epsilon 8 with De et al.'s augmentation multiplicity; 71.8% at epsilon "
        "7.42 without it, as Hölzl et al. cite it",
        translated="one view per example and 20 epochs at batch 4096 (lr 2, no momentum, clip 2, as De et al.'s "
        "recipe that the paper follows) so that it fits a device call beside the others; no EMA",
        dataset="cifar10",
        build=scalenorm_resnet9,
        optimizer=sgd(2.0),
        batch_size=4096,
        epochs=20,
        epsilon=8.0,
        delta=1e-5,
        max_grad_norm=2.0,
        normalize=CIFAR10_MEAN_STD,
        input_size=32,
        physical_batch_size=256,  # 1024 holds ~80 GB for the converted arms on an H200
    )
)
