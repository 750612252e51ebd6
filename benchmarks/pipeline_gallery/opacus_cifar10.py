"""Opacus' own CIFAR-10 example (opacus/examples/cifar10.py, Opacus 1.6): its `convnet`, four 3x3 convs with ReLU
and average pooling, no normalisation layer, a linear head after global average pooling."""

from __future__ import annotations

from torch import nn

from .base import CIFAR10_MEAN_STD, Pipeline, register, scaled, sgd


def convnet(width: float = 1.0, num_classes: int = 10) -> nn.Module:
    c1, c2, c3, c4 = (scaled(c, width) for c in (32, 64, 64, 128))
    return nn.Sequential(
        nn.Conv2d(3, c1, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(c1, c2, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(c2, c3, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(c3, c4, kernel_size=3, stride=1, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(start_dim=1, end_dim=-1),
        nn.Linear(c4, num_classes, bias=True),
    )


register(
    Pipeline(
        name="opacus_cifar10",
        source="Opacus, examples/cifar10.py (github.com/pytorch/opacus), model `convnet`",
        published="no accuracy is published for this script; its defaults: SGD lr 0.1 momentum 0.9, clip 10, "
        "batch 2000, noise 1.5",
        translated="trained for 30 epochs at epsilon 8 (noise calibrated) instead of the script's fixed noise 1.5 "
        "for 90 epochs; no augmentation, as the script's DP branch",
        dataset="cifar10",
        build=convnet,
        optimizer=sgd(0.1, momentum=0.9),
        batch_size=2000,
        epochs=30,
        epsilon=8.0,
        delta=1e-5,
        max_grad_norm=10.0,
        normalize=CIFAR10_MEAN_STD,
        input_size=32,
    )
)
