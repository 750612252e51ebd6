"""De, Berrada, Hayes, Smith, Balle (2022), "Unlocking high-accuracy differentially private image classification
through scale": the WRN-16-4 with GroupNorm on CIFAR-10 (benchmarks/wrn.py builds it, 2.75M parameters)."""

from __future__ import annotations

from torch import nn

from wrn import WideResNet

from .base import CIFAR10_MEAN_STD, Pipeline, register, sgd


def wrn_16_4(width: float = 1.0, num_classes: int = 10) -> nn.Module:
    return WideResNet(depth=16, width=4 * width, num_classes=num_classes)


register(
    Pipeline(
        name="de_wrn16_4_cifar10",
        source="De, Berrada, Hayes, Smith, Balle, arXiv:2204.13650 (2022), github.com/deepmind/jax_privacy",
        published="81.4% on CIFAR-10 at epsilon 8 with augmentation multiplicity 16, weight standardisation and "
        "parameter averaging over 2,500 steps of batch 4096 (WRN-16-4)",
        translated="JAX to torch; one view per example, plain convolutions (no weight standardisation), no "
        "parameter averaging, and 20 epochs (244 steps) of their batch 4096, lr 4, no momentum, clip 1 at epsilon 8, "
        "so that it fits a device call",
        dataset="cifar10",
        build=wrn_16_4,
        optimizer=sgd(4.0),
        batch_size=4096,
        epochs=20,
        epsilon=8.0,
        delta=1e-5,
        max_grad_norm=1.0,
        normalize=CIFAR10_MEAN_STD,
        input_size=32,
        physical_batch_size=512,
    )
)
