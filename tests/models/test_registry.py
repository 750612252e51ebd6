"""The model registry: one set of names for the library, `equiconvert convert` and `equiconvert train`."""

from __future__ import annotations

import json

import pytest
from torch import nn

import equiconvert
from equiconvert.cli import main
from equiconvert.models import ModelNameError, create_model, list_models, register_model
from equiconvert.models._registry import _MODELS, is_equivariant_model, resolve_model_name
from tests.support.train_args import tiny_train_args

PAPER_PLAIN_PARAMS = 155_434  # the paper preset's unconverted network, 10 classes, 3 channels


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_list_models_names_equiconverts_own_and_other_sources_by_prefix():
    assert {"resnet9", "equivariant_resnet9", "plain_paper_resnet9"} <= set(list_models())
    assert list_models("equivariant_*") == ["equivariant_resnet9"]
    assert list_models("equiconvert:resnet9") == ["resnet9"]
    assert "torchvision:resnet18" in list_models("torchvision:resnet1*")
    assert "timm:resnet18" in list_models("timm:resnet18")
    with pytest.raises(ModelNameError, match="keras"):
        list_models("keras:*")


def test_bare_names_resolve_equiconvert_then_torchvision_then_timm():
    assert resolve_model_name("resnet9") == resolve_model_name("equiconvert:resnet9") == "equiconvert:resnet9"
    assert resolve_model_name("resnet18") == "torchvision:resnet18"  # timm has one too: torchvision comes first
    assert resolve_model_name("resnet50d") == "timm:resnet50d"  # timm's only
    assert type(create_model("resnet18")).__module__.startswith("torchvision.")
    assert type(create_model("timm:resnet18", num_classes=3, in_channels=1)).__module__.startswith("timm.")


def test_create_model_drops_none_and_builds_the_same_model_under_every_name():
    small = create_model("resnet9", widths=(4, 8, 8), num_classes=5, norm=None)
    assert _count(small) == _count(create_model("equiconvert:resnet9", widths=(4, 8, 8), num_classes=5))
    assert _count(create_model("resnet9", widths=None)) == _count(equiconvert.models.resnet9())
    assert small.head[-1].out_features == 5


def test_timm_in_chans_names_the_input_channels_of_every_source():
    one_channel = create_model("equiconvert:resnet9", widths=(4, 8, 8), in_chans=1)
    assert one_channel.stem[0].in_channels == 1
    assert create_model("timm:resnet10t", in_chans=1).conv1[0].in_channels == 1
    with pytest.raises(ModelNameError, match="in_channels or in_chans"):
        create_model("equiconvert:resnet9", in_channels=1, in_chans=1)


def test_paper_preset_variants_are_keyword_arguments():
    plain = create_model("plain_paper_resnet9")
    assert _count(plain) == PAPER_PLAIN_PARAMS
    assert any(isinstance(m, nn.Tanh) for m in create_model("plain_paper_resnet9", act="tanh").modules())
    assert _count(create_model("plain_paper_resnet9", res2=False)) < _count(plain)
    assert _count(create_model("plain_paper_resnet9", pool_after_res2=True)) == _count(plain)
    groups = {
        m.num_groups
        for m in create_model("plain_paper_resnet9", norm_groups=4).modules()
        if isinstance(m, nn.GroupNorm)
    }
    assert groups == {4}
    with pytest.raises(ModelNameError, match="swish"):
        create_model("plain_paper_resnet9", act="swish")
    assert is_equivariant_model("equivariant_resnet9") and not is_equivariant_model("resnet9")
    preset = create_model("equivariant_resnet9", group="D4", act="tanh")
    assert _count(preset) == 255_675  # Table 1 (D4): the activation has no parameters
    assert any(isinstance(m, nn.Tanh) for m in preset.modules())


def test_unknown_names_and_keywords_fail_with_close_names():
    with pytest.raises(ModelNameError, match="close names: resnet9"):
        create_model("resnet99")
    with pytest.raises(ModelNameError, match=r"known: .*resnet9"):
        create_model("equiconvert:resnt9")
    with pytest.raises(ModelNameError, match="cannot parse model 'keras:resnet18'"):
        create_model("keras:resnet18")
    with pytest.raises(ModelNameError, match="close names: resnet18"):
        create_model("torchvision:resnt18")
    with pytest.raises(ModelNameError, match="takes no keyword argument 'depth'"):
        create_model("resnet9", depth=3)
    with pytest.raises(ModelNameError, match="3 input channels"):
        create_model("torchvision:resnet18", in_channels=1)


def test_register_model_adds_a_name_and_refuses_a_taken_one():
    try:

        @register_model
        def tiny_test_net(num_classes: int = 10, in_channels: int = 3) -> nn.Module:
            return nn.Sequential(nn.Conv2d(in_channels, num_classes, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())

        assert "tiny_test_net" in list_models()
        assert create_model("equiconvert:tiny_test_net", num_classes=4)[0].out_channels == 4
        with pytest.raises(ModelNameError, match="taken"):
            register_model(name="tiny_test_net")(tiny_test_net)
    finally:
        _MODELS.pop("tiny_test_net", None)


@pytest.mark.parametrize("name", ["equivariant_resnet9", "resnet9", "equiconvert:resnet9", "torchvision:resnet18"])
def test_convert_and_train_accept_the_same_names(name, tmp_path, capsys):
    assert main(["convert", name, "--group", "D1", "--no-check", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["model"] == name and record["group"] == "D1" and record["params_after"] > 0
    if name == "equivariant_resnet9":  # built for the group, not converted twice
        assert record["params_before"] == PAPER_PLAIN_PARAMS
    widths = [] if name in ("equivariant_resnet9", "torchvision:resnet18") else ["--model-kwargs", "widths=4,8,8"]
    out = tmp_path / "run"
    assert main(tiny_train_args(out, *widths, model=name, group="none")) == 0
    result = json.loads((out / "result.json").read_text())
    if name == "equivariant_resnet9":  # --group none: the plain network the preset converts
        expected = PAPER_PLAIN_PARAMS
    else:  # BatchNorm -> GroupNorm keeps the parameter count
        expected = _count(create_model(name, num_classes=10, widths=(4, 8, 8) if "resnet9" in name else None))
    assert result["model"] == name and result["steps"] == 1 and result["params"] == expected
    assert (result["activation"] == "mish") == (name == "equivariant_resnet9")  # the preset's own options apply
