"""Reference (non-equivariant) CNN architectures that equiconvert converts, and the paper's preset."""

from equiconvert.models.equivariant_resnet9 import equivariant_resnet9
from equiconvert.models.resnet9 import ResNet9, resnet9

__all__ = ["ResNet9", "equivariant_resnet9", "resnet9"]
