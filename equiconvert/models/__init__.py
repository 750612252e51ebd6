"""Reference (non-equivariant) CNN architectures that equiconvert converts, the paper's preset, and the registry
that builds every model by name (`create_model("equivariant_resnet9", group="D4")`, `create_model("torchvision:resnet18")`).
"""

from equiconvert.models._registry import ModelNameError, create_model, list_models, register_model
from equiconvert.models.equivariant_resnet9 import equivariant_resnet9, plain_paper_resnet9
from equiconvert.models.resnet9 import ResNet9, resnet9
from equiconvert.models.small_cnn import SmallCNN, small_cnn

__all__ = [
    "ModelNameError",
    "ResNet9",
    "SmallCNN",
    "create_model",
    "equivariant_resnet9",
    "list_models",
    "plain_paper_resnet9",
    "register_model",
    "resnet9",
    "small_cnn",
]
