"""A timm model as a user would take it for DP training: `timm.create_model("resnet10t", ...)` with GroupNorm in
place of BatchNorm, trained with Opacus' CIFAR-10 example settings scaled to its size."""

from __future__ import annotations

from torch import nn

from .base import CIFAR10_MEAN_STD, Pipeline, register, scaled, sgd


def group_norm8(channels: int, **_factory: object) -> nn.Module:
    """GroupNorm with 8 groups; timm calls norm layers with the channel count (and device/dtype keywords)."""
    return nn.GroupNorm(8, channels)


def timm_resnet10t_gn(width: float = 1.0, num_classes: int = 10) -> nn.Module:
    import timm

    channels = [8 * max(1, round(scaled(c, width) / 8)) for c in (64, 128, 256, 512)]
    return timm.create_model(
        "resnet10t",
        pretrained=False,
        num_classes=num_classes,
        norm_layer=group_norm8,
        channels=channels,
        stem_width=32 * max(1, round(scaled(32, width) / 32)),  # its tiered stem is 3/4 and 1 of this
    )


register(
    Pipeline(
        name="timm_resnet10t_gn_cifar10",
        source="timm.create_model('resnet10t', norm_layer=GroupNorm(8)) (github.com/huggingface/pytorch-image-models)",
        published="none: a pipeline a timm user writes, De et al.'s recipe shape (SGD momentum 0.9, lr 1, clip 1)",
        translated="not a published pipeline; chosen as what a timm user would start from",
        dataset="cifar10",
        build=timm_resnet10t_gn,
        optimizer=sgd(1.0, momentum=0.9),
        batch_size=1024,
        epochs=15,
        epsilon=8.0,
        delta=1e-5,
        max_grad_norm=1.0,
        normalize=CIFAR10_MEAN_STD,
        input_size=32,
        physical_batch_size=512,
    )
)
