"""The Equivariant-ResNet9 of Hölzl, Rueckert and Kaissis, "Equivariant Differentially Private
Deep Learning" (Table 1), obtained by converting a plain ResNet9 with the paper's choices.

Width: fields = floor(C * sqrt(1.5 |G|) / |G|) for the layout (16, 32, 64), the
constant of the paper's released code (the text says 1.75), with the steerable
basis band-limited at angular frequency 3r on the ring of radius r (the released
code's `frequencies_cutoff`; escnn's default basis is ~25% smaller and misses
Table 1 by that much). With restriction "halved" before conv4 (layer3) the whole
64-channel stage is sized for D_{N/2} / C_{N/2}. These reproduce Table 1 exactly:
C4 258,328; C8 255,675; C16 244,397; D4 255,675; D8 244,397; D16 237,995.

O(2) (frequency 1): hidden fields are gated induced fields of size 9 (trivial +
sign + 2 psi_1 + 3 gates, see groups.FieldLayout), and the width rule with the
field size in place of |G| and kappa 1.75 (the paper's text constant) gives
215,428 parameters, 0.2% from Table 1's 215k (kappa 1.5 would give 185,438).
No restriction, as in the paper.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import ParameterError
from ..convert import make_equivariant
from ..conversion_options import KEEP_HEAD
from ..convert.context import ConversionConfig
from ..convert.report import EquivarianceWarning
from ..convert.model import EquivariantModel
from ..conversion_options import PAPER_KAPPA
from ..convert.width import RELEASED_CODE_KAPPA, kappa_width
from ..groups import ContinuousGroupSpec, parse_group
from ._registry import ModelNameError, register_model
from .resnet9 import BlockOptions, ResNet9

PAPER_LAYOUT = (16, 32, 64)
PAPER_NORM_GROUPS = 8
PAPER_BASIS_CUTOFF = 3.0
PAPER_RESTRICTION = {"layer3": "halved"}  # "before conv4", the last stage
# Not the paper's: its code starts the filters at escnn's scale (gain ~1), ours at gain 1/sqrt(2). Under weight
# standardization a smaller start makes the filters learn faster and take a larger share of the clipped per-sample
# gradient (docs/guides/reproducing-the-paper.md, "Coefficients").
PRESET_INIT_GAIN = 2**-0.5
# Pointwise activations the preset can be built with (Mish: the paper's). Tempered sigmoids (tanh) and SELU are the
# DP literature's alternatives (Papernot et al. 2021; Cheng et al.'s DPNAS); every one is equivariant on regular fields.
PAPER_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "mish": nn.Mish,
    "tanh": nn.Tanh,
    "selu": nn.SELU,
    "elu": nn.ELU,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "gelu": nn.GELU,
}

TABLE1_PARAMS = {  # 10 classes
    "C4": 258_328,
    "C8": 255_675,
    "C16": 244_397,
    "D4": 255_675,
    "D8": 244_397,
    "D16": 237_995,
    "O2": 215_000,
}


@dataclass(frozen=True)
class PresetOptions:
    """The preset's block and last-stage choices: the paper's Mish, GroupNorm(8), res2 kept at 4x4."""

    activation: str = "mish"  # a PAPER_ACTIVATIONS name
    norm_groups: int = PAPER_NORM_GROUPS
    res2: bool = True  # the last residual block kept
    pool_after_res2: bool = False  # res2 at 4x4 (32x32 inputs)

    @classmethod
    def resolve(
        cls,
        activation: str | None = None,
        norm_groups: int | None = None,
        res2: bool | None = None,
        pool_after_res2: bool | None = None,
    ) -> PresetOptions:
        """The options as built from a user's choices, None meaning the preset's own; an unknown activation is
        refused."""
        given = {"activation": activation, "norm_groups": norm_groups, "res2": res2, "pool_after_res2": pool_after_res2}
        options = cls(**{k: v for k, v in given.items() if v is not None})
        paper_activation(options.activation)
        return options


PRESET = PresetOptions()


def paper_activation(act: type[nn.Module] | str) -> type[nn.Module]:
    """An activation class, given as one or by its PAPER_ACTIVATIONS name ("mish", "tanh", ...)."""
    if not isinstance(act, str):
        return act
    if act not in PAPER_ACTIVATIONS:
        raise ModelNameError(f"activation {act!r} is not one of {sorted(PAPER_ACTIVATIONS)}")
    return PAPER_ACTIVATIONS[act]


@register_model
def plain_paper_resnet9(
    num_classes: int = 10,
    in_channels: int = 3,
    layout=PAPER_LAYOUT,
    act: type[nn.Module] | str = PRESET.activation,
    norm_groups: int = PRESET.norm_groups,
    res2: bool = PRESET.res2,
    pool_after_res2: bool = PRESET.pool_after_res2,
) -> ResNet9:
    """The non-equivariant network the preset converts: conv -> act (Mish) -> GroupNorm(8, no affine) -> pool;
    res2=False leaves out the last residual block (the 4x4 stage), pool_after_res2 runs it at 8x8.
    act: a module class or a PAPER_ACTIVATIONS name."""
    if norm_groups < 1 or any(channels % norm_groups for channels in layout):
        raise ParameterError(
            f"norm_groups={norm_groups} must divide every width of the layout {tuple(layout)} "
            "(GroupNorm splits channels evenly), e.g. 1, 2, 4, 8 or 16 for (16, 32, 64)"
        )
    options = BlockOptions(block_order="conv-act-norm", conv_bias=True, norm_affine=False, norm_groups=norm_groups)
    return ResNet9(
        num_classes,
        in_channels,
        layout,
        norm="group",
        scale_norm=True,
        act=paper_activation(act),
        options=options,
        head_pool="avg",
        res2=res2,
        pool_after_res2=pool_after_res2,
    )


@register_model(equivariant=True, baseline="plain_paper_resnet9", preset=PresetOptions)
def equivariant_resnet9(
    group: str = "D4",
    num_classes: int = 10,
    in_channels: int = 3,
    *,
    layout=PAPER_LAYOUT,
    restrict: Any = "paper",
    head: str = KEEP_HEAD,
    width: Any = None,
    input_size: int = 32,
    frequency: int | None = None,
    act: type[nn.Module] | str = PRESET.activation,
    norm_groups: int = PRESET.norm_groups,
    res2: bool = PRESET.res2,
    pool_after_res2: bool = PRESET.pool_after_res2,
    **config: Any,
) -> EquivariantModel:
    """The paper's Equivariant-ResNet9 for `group` ("C4", "D4", ..., "SO2", "O2").

    restrict="paper" restricts "halved" before layer3 for C_N/D_N with even N (the
    paper) and nothing otherwise; pass None, a step or a schedule to change it.
    head="keep": group pooling, AdaptiveAvgPool2d(2), Flatten, Linear (the paper;
    not rotation invariant); head="invariant": global pooling, exactly invariant.
    act: the pointwise activation, a module class or a PAPER_ACTIVATIONS name (the paper's Mish).
    norm_groups: the GroupNorm groups of the plain network (the paper's 8); a converted norm gets as many groups of
    whole fields, at most one per field.
    res2=False: without the last residual block (48% of the D1 model's parameters; not the paper's).
    pool_after_res2: layer3's pooling moved after res2, which then sees 8x8 maps instead of 4x4 (32x32 inputs): the
    same parameters, more FLOPs (not the paper's).
    Extra keyword arguments are ConversionConfig fields. The released code's (hlzl/equivariant) choices where ours
    differ: weight_standardization="layer" (each conv's whole coefficient vector, not each output field's),
    norm_group_rule="released" (its groups for 8 asked: 1, 1, 3, 3 by stage for D4, not min(fields, 8)) and
    unit_norm_bias=True (a field's bias added as bias / sqrt(field size) per channel); none changes the parameter
    count. docs/guides/reproducing-the-paper.md lists every difference; recipe cifar10_paper_d4_eps8_released.
    """
    options = {
        "weight_standardization": True,
        "basis_cutoff": PAPER_BASIS_CUTOFF,
        "init_gain": PRESET_INIT_GAIN,
        "unit_invariants": False,  # the paper's group pooling: a plain max over each field
        **config,
    }
    if restrict == "paper":
        restrict = _paper_restriction(group)
    cfg = ConversionConfig(**options)
    cfg.restrict = restrict
    plain = plain_paper_resnet9(num_classes, in_channels, layout, act, norm_groups, res2, pool_after_res2)
    if width is None:
        width = kappa_width(PAPER_KAPPA if _is_continuous(group) else RELEASED_CODE_KAPPA)
    with warnings.catch_warnings():
        if head == KEEP_HEAD:  # the paper's head flattens a 2x2 grid by design: the report says so, no warning
            warnings.filterwarnings("ignore", PAPER_HEAD_WARNING, EquivarianceWarning)
        return make_equivariant(
            plain, group, width=width, input_size=input_size, config=cfg, head=head, frequency=frequency
        )


# what make_equivariant warns about the paper's head (convert/rules/head.py's to_vector), a regex of its message
PAPER_HEAD_WARNING = r".*flattens a 2x2 grid: rotations permute its cells"


def _is_continuous(group: str) -> bool:
    return isinstance(parse_group(group), ContinuousGroupSpec)


def _paper_restriction(group: str) -> Any:
    spec = parse_group(group)
    halvable = getattr(spec, "kind", None) in ("C", "D") and spec.n % 2 == 0
    return dict(PAPER_RESTRICTION) if halvable else None
