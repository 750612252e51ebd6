"""Opacus' tutorial "Building an Image Classifier with Differential Privacy": torchvision's ResNet-18 with its
BatchNorm replaced by GroupNorm (ModuleValidator.fix), trained with RMSprop."""

from __future__ import annotations

import torch
import torchvision
from torch import nn

from .base import CIFAR10_MEAN_STD, Pipeline, group_norm_width, register


def groupnorm_resnet18(width: float = 1.0, num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 (base width 64 x `width`) with GroupNorm(min(32, C), C), as Opacus'
    ModuleValidator.fix makes its BatchNorms."""
    base = group_norm_width(64, width)

    def norm(channels: int) -> nn.Module:
        return nn.GroupNorm(min(32, channels), channels)

    class WidenedResNet18(torchvision.models.resnet.ResNet):
        def __init__(self) -> None:
            super().__init__(
                torchvision.models.resnet.BasicBlock, [2, 2, 2, 2], num_classes=num_classes, norm_layer=norm
            )
            if base == 64:
                return
            nn.Module.__init__(self)
            block = torchvision.models.resnet.BasicBlock
            self._norm_layer, self.inplanes, self.dilation, self.groups, self.base_width = norm, base, 1, 1, 64
            self.conv1 = nn.Conv2d(3, base, kernel_size=7, stride=2, padding=3, bias=False)
            self.bn1 = norm(base)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
            self.layer1 = self._make_layer(block, base, 2)
            self.layer2 = self._make_layer(block, 2 * base, 2, stride=2)
            self.layer3 = self._make_layer(block, 4 * base, 2, stride=2)
            self.layer4 = self._make_layer(block, 8 * base, 2, stride=2)
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(8 * base, num_classes)

    return WidenedResNet18()


def rmsprop(params) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(params, lr=1e-3)


register(
    Pipeline(
        name="opacus_resnet18_cifar10",
        source="Opacus tutorial 'Building an Image Classifier with Differential Privacy' (opacus.ai/tutorials)",
        published="about 60% at epsilon 50 after 20 epochs (the tutorial's run: batch 512, RMSprop lr 1e-3, "
        "clip 1.2, delta 1e-5)",
        translated="10 epochs instead of 20 so that it fits a device call beside the others; CIFAR-10's JPEG copy",
        dataset="cifar10",
        build=groupnorm_resnet18,
        optimizer=rmsprop,
        batch_size=512,
        epochs=10,
        epsilon=50.0,
        delta=1e-5,
        max_grad_norm=1.2,
        normalize=CIFAR10_MEAN_STD,
        input_size=32,
        physical_batch_size=512,
    )
)
