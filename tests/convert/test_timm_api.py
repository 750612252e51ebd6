"""A converted timm model keeps timm's model API, with values true of the converted network, on three families."""

import copy

import pytest
import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.optim import create_optimizer_v2

import equiconvert
from equiconvert.convert.timm_api import TimmEquivariantModel

FAMILIES = {  # timm's own small test models; ConvNeXt's 4x4 stem needs even_kernels="grow"
    "test_resnet": {},
    "test_efficientnet": {},
    "test_convnext": {"config": {"even_kernels": "grow"}},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request):
    original = timm.create_model(request.param, pretrained=False, num_classes=5, in_chans=1)
    return equiconvert.make_equivariant(original, group="C4", head="invariant", **FAMILIES[request.param]).eval()


def test_data_config_is_a_valid_size_with_the_models_channels(converted):
    config = resolve_data_config(model=converted)
    channels, height, width = config["input_size"]
    assert isinstance(converted, TimmEquivariantModel)
    assert channels == 1 and height == width and height in converted.report.valid_input_sizes
    assert len(config["mean"]) == len(config["std"]) == 1
    image = create_transform(**config)(Image.new("L", (300, 260)))
    assert image.shape == (1, height, width)
    train_image = create_transform(**config, is_training=True)(Image.new("L", (300, 260)))
    assert train_image.shape == (1, height, width)


def test_features_and_head_compose_to_the_model(converted):
    size = converted.default_input_size()
    x = torch.randn(2, 1, size, size)
    with torch.no_grad():
        features = converted.forward_features(x)
        assert features.dim() == 4 and features.shape[1] == converted.num_features
        torch.testing.assert_close(converted.forward_head(features), converted(x))
        pre_logits = converted.forward_head(features, pre_logits=True)
    assert pre_logits.shape == (2, converted.get_classifier().in_features)
    assert converted.num_classes == 5 and converted.default_cfg == converted.pretrained_cfg


def test_reset_classifier_changes_the_classes_and_timm_builds_an_optimizer(converted):
    model = copy.deepcopy(converted)
    size = model.default_input_size()
    model.reset_classifier(3)
    assert model.num_classes == 3 and model.pretrained_cfg["num_classes"] == 3
    assert model.get_classifier() is model.get_submodule(model.pretrained_cfg["classifier"])
    with torch.no_grad():
        assert model(torch.randn(2, 1, size, size)).shape == (2, 3)
        model.reset_classifier(0)
        assert model(torch.randn(2, 1, size, size)).shape == (2, model.head_hidden_size)
    assert create_optimizer_v2(model, "sgd", lr=0.1, weight_decay=1e-4).param_groups
    with pytest.raises(ValueError, match="global_pool='max'.*convert it again"):
        model.reset_classifier(3, global_pool="max")
