"""The layout of image batches, (N, C, H, W): one clear error for channels-last, (N, H, W) or other-channel images.

A convolution given such images fails deep inside with its weight's shape ("expected input[3, 9, 9, 3] to have 3
channels"), or, for (N, H, W), reads the batch as one unbatched image; the error here says what to pass instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .errors import DataError

CHANNEL_COUNTS = (1, 3, 4)  # grey, RGB, RGBA: a last dimension of these sizes looks like channels-last


class ImageShapeError(DataError, ValueError):
    """Images whose shape is not the (N, C, H, W) a model takes."""


def first_conv_channels(model: nn.Module) -> int | None:
    """The input channels of `model` (an equiconvert model's own count, else its first 2-D convolution's), or None."""
    channels = getattr(model, "in_channels", None)
    if isinstance(channels, int):
        return channels
    return next((m.in_channels for m in model.modules() if isinstance(m, nn.Conv2d)), None)


def image_shape_message(shape: Sequence[int], channels: int | None, what: str) -> str:
    """`what` of `shape` do not fit a model taking (N, `channels`, H, W): the one-line message, with what to do."""
    want = f"(N, {channels if channels is not None else 'C'}, H, W)"
    shape = tuple(shape)
    if len(shape) == 3:
        fix = "add the channel dimension, images.unsqueeze(1)" if channels in (1, None) else f"give {want} images"
    elif len(shape) == 4 and shape[1] != channels and shape[-1] in ((channels,) if channels else CHANNEL_COUNTS):
        fix = "they look channels-last (N, H, W, C): give images.permute(0, 3, 1, 2)"
    else:
        fix = f"give {want} images with the channels the model's first layer takes"
    return f"{what} have shape {shape} but the model takes {want}: {fix}"


def check_image_shape(shape: Sequence[int], channels: int, what: str = "images") -> None:
    """Refuse a batch shape other than (N, `channels`, H, W)."""
    if len(shape) != 4 or shape[1] != channels:
        raise ImageShapeError(image_shape_message(shape, channels, what))
