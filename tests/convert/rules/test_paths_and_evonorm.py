"""Selective kernels, split attention, VGG's ConvMlp, EvoNorm and nested channel splits (tiny models, float64)."""

import pytest
import torch
from torch import nn

import equiconvert
from equiconvert.convert.rules.split import _closed_partitions
from equiconvert.nn.evo_norm import FieldEvoNorm

from timm.layers import evo_norm
from timm.layers.selective_kernel import SelectiveKernel
from timm.layers.split_attn import SplitAttn
from timm.models.vgg import ConvMlp


def _exact(model: nn.Module, **kwargs) -> equiconvert.EquivariantModel:
    converted = equiconvert.make_equivariant(model.eval(), "C4", head="invariant", **kwargs).eval().double()
    assert converted.report.valid_input_sizes and converted.report.invariant_output
    assert equiconvert.check_equivariance(converted, batch_size=2).max_error <= 1e-10
    return converted


def _classifier(*body: nn.Module, channels: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), *body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 3)
    )


def test_selective_kernel_converts_exactly_and_weights_whole_fields():
    model = _classifier(SelectiveKernel(16, 16, kernel_size=[3, 5]), SelectiveKernel(16, 16, split_input=True))
    converted = _exact(model)
    assert sum("FieldPathAttention" in change.after for change in converted.report.layers) == 2


def test_split_attention_converts_exactly_with_radix_two_and_one():
    _exact(_classifier(SplitAttn(16, 16, radix=2, groups=2), SplitAttn(16, 16, radix=1)))


def test_conv_mlp_head_traces_and_pools_small_maps_up_symmetrically():
    model = _classifier(ConvMlp(16, 16, kernel_size=5, drop_rate=0.0))
    converted = _exact(model)
    assert 8 in converted.report.valid_input_sizes
    assert equiconvert.check_equivariance(converted, input_size=3).max_error <= 1e-10  # 3 < 5: pooled up to 5


@pytest.mark.parametrize(
    "name,apply_act",
    [
        ("EvoNorm2dS0", True),
        ("EvoNorm2dS0", False),
        ("EvoNorm2dS0a", True),
        ("EvoNorm2dS1", True),
        ("EvoNorm2dS1", False),
        ("EvoNorm2dS1a", True),
        ("EvoNorm2dS2", True),
        ("EvoNorm2dS2a", False),
    ],
)
def test_field_evo_norm_with_one_channel_fields_is_timms(name, apply_act):
    torch.manual_seed(0)
    timm_norm = getattr(evo_norm, name)(12, groups=4, apply_act=apply_act)
    for p in timm_norm.parameters():
        p.data.normal_()
    statistic = "rms" if "S2" in name else "std"
    swish = getattr(timm_norm, "v", None) is not None
    normalize = swish or name.endswith("a") or timm_norm.apply_act
    field = FieldEvoNorm(12, 1, 4, statistic, normalize, getattr(timm_norm, "act", None), swish, timm_norm.eps)
    field.load_state_dict({k: v for k, v in timm_norm.state_dict().items()})
    x = torch.randn(3, 12, 5, 5)
    torch.testing.assert_close(field(x), timm_norm(x))


def test_sample_wise_evo_norms_convert_exactly():
    model = _classifier(
        evo_norm.EvoNorm2dS0(16, groups=4),
        nn.Conv2d(16, 16, 3, padding=1),
        evo_norm.EvoNorm2dS1(16, groups=8),
        evo_norm.EvoNorm2dS2a(16, group_size=4),
    )
    converted = _exact(model)
    assert sum("FieldEvoNorm" in change.after for change in converted.report.layers) == 3


def test_batch_evo_norm_is_refused_by_name():
    with pytest.raises(equiconvert.UnsupportedLayerError, match="EvoNorm2dB0 divides by a batch variance.*Options"):
        equiconvert.make_equivariant(_classifier(evo_norm.EvoNorm2dB0(16)), "C4")


def test_nested_splits_cut_every_piece_the_same_way():
    partitions = _closed_partitions({480: {(240, 240), (160, 160, 160)}, 240: {(80, 40, 40, 80)}})
    # the thirds of 480 start at 0, 160 and 320, which the cuts of 240 (80, 120, 160) place differently in each;
    # every 160-channel piece must be cut alike (its field count is one number), so all pieces end at 40
    assert partitions == {480: (40,) * 12, 240: (40,) * 6, 160: (40,) * 4, 80: (40, 40)}
    for channels, pieces in ((480, (240, 240)), (480, (160, 160, 160))):
        bounds = {sum(pieces[:i]) for i in range(len(pieces) + 1)}
        finest = {sum(partitions[channels][:i]) for i in range(len(partitions[channels]) + 1)}
        assert bounds <= finest


class _OneSidedPadStem(nn.Module):
    """HGNet's stem pattern: a one-sided pad before a 2x2 conv and a 2x2 stride-1 max pool, then a symmetric pad."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(16, 8, 2), nn.Conv2d(24, 16, 3)
        self.pool = nn.MaxPool2d(2, 1, ceil_mode=True)

    def forward(self, x):
        x = torch.nn.functional.pad(x, (0, 1, 0, 1))
        x = torch.cat([self.pool(x), self.conv(x)], 1)
        return self.conv2(torch.nn.functional.pad(x, (1, 1, 1, 1)))


def test_one_sided_pad_before_two_by_two_windows_grows_to_a_centred_one():
    model = _classifier(_OneSidedPadStem())
    x = torch.randn(1, 3, 9, 9)
    converted = _exact(model, config={"even_kernels": "grow"})
    assert converted(x.double()).shape == model(x).shape
    assert any("pad (1, 1, 1, 1)" in change.after for change in converted.report.layers)


def test_one_sided_pad_is_refused_without_grow():
    with pytest.raises(equiconvert.UnsupportedLayerError, match=r"pads \(0, 1, 0, 1\).*even_kernels"):
        equiconvert.make_equivariant(_classifier(_OneSidedPadStem()), "C4")


def test_grouped_conv_multiples_reach_the_pieces_of_a_sliced_count():
    from equiconvert.convert.rules.split import _piece_multiples

    partitions = {128: (16,) * 8, 640: (512, 64, 64)}
    found = _piece_multiples(partitions, {128: 32, 512: 32, 256: 4})
    assert found == {16: 4, 512: 32, 256: 4}  # 8 pieces of 16 sum to a multiple of 32 when each is a multiple of 4


class _DualPath(nn.Module):
    """DPN's pattern: a grouped conv beside channel slices of a map whose pieces a residual adds back."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.grouped = nn.Conv2d(16, 24, 1), nn.Conv2d(16, 16, 3, padding=1, groups=4)
        self.out = nn.Conv2d(16, 16, 1)

    def forward(self, x):
        s = self.proj(x)
        return torch.cat([s[:, :16] + self.out(self.grouped(x)), s[:, 16:]], 1)


def test_slices_beside_grouped_convs_convert_exactly():
    _exact(_classifier(_DualPath(), nn.Conv2d(24, 16, 1)))


def test_path_attention_and_evo_norm_give_per_sample_gradients_and_pickle():
    import pickle

    from tests.support.per_sample_check import assert_per_sample_gradients_match_loop

    torch.manual_seed(0)
    model = _classifier(
        SelectiveKernel(16, 16, kernel_size=[3, 5]),
        evo_norm.EvoNorm2dS0(16, groups=4),
        SplitAttn(16, 16, radix=2, groups=2),
    )
    converted = equiconvert.make_equivariant(model, "C4", head="invariant").eval()
    x, y = torch.randn(3, 3, 9, 9), torch.tensor([0, 2, 1])
    assert_per_sample_gradients_match_loop(converted, x, y)
    with torch.no_grad():
        assert torch.equal(pickle.loads(pickle.dumps(converted))(x), converted(x))


def test_check_equivariance_draws_its_input_in_the_models_dtype():
    converted = equiconvert.make_equivariant(_classifier(nn.ReLU()), "C4", head="invariant").eval()
    assert equiconvert.check_equivariance(converted.double()).max_error <= 1e-12  # float64 end to end


def test_space_to_depth_stem_makes_regular_fields_for_rotations_and_is_refused_with_reflections():
    from timm.layers import BlurPool2d, SpaceToDepth

    def model():
        return nn.Sequential(
            SpaceToDepth(),
            nn.Conv2d(48, 16, 3, padding=1),
            BlurPool2d(16, stride=2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 3),
        )

    converted = equiconvert.make_equivariant(model().eval(), "C4", head="invariant").eval().double()
    assert converted.in_channels == 3 and converted.report.valid_input_sizes[0] % 4 == 0
    assert equiconvert.check_equivariance(converted, batch_size=2).max_error <= 1e-10
    with pytest.raises(equiconvert.UnsupportedLayerError, match="D4 fixes some positions.*Options"):
        equiconvert.make_equivariant(model(), "D4", head="invariant")


def test_reflect_padding_on_every_side_is_kept():
    class Reflect(nn.Module):
        def forward(self, x):
            return torch.nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")

    _exact(_classifier(Reflect(), nn.Conv2d(16, 16, 5)))
