"""Reference (non-equivariant) CNN architectures that equiconvert converts."""

from equiconvert.models.resnet9 import ResNet9, resnet9

__all__ = ["ResNet9", "resnet9"]
