"""Pretrained weights carried into a converted model, so that it computes the group average of the pretrained network.

With one regular field per original channel, a steerable layer whose filter from input field c' to output field c
is block-diagonal over the group index, block h being the pretrained filter W[c, c'] moved by the grid element h,
runs |G| copies of the original layer, copy h on the input moved by h^-1 (a lifting layer from trivial input
channels uses the moved filters directly). ReLU, spatial pooling and biases act channel by channel, so every copy
stays the original network. Mean group pooling before the head averages the copies' features, and the linear
head maps that average to the average of the pretrained logits over the group's moved inputs.

Steerable convolutions hold basis coefficients: the block-diagonal filter is projected onto the layer's basis by
least squares, exactly when it lies in the span (a basis_cutoff of 5 spans every 3x3, 5x5 and 7x7 filter of C4
and D4; escnn's default band limit does not).
A field norm takes its statistics over all |G| copies of a field, not per copy as the pretrained norm: its affine
parameters carry over, the network only approximates the average, and the report measures by how much.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..convert import EquivariantModel, make_equivariant
from ..convert.input_fit import FIT_MODULE
from ..errors import UnsupportedLayerError, UsageError
from ..groups import GroupSpec, parse_group
from ..nn.conv import SteerableConv2d
from ..nn.norm import FieldGroupNorm
from ..nn.pooling import GroupPool
from .cost import ForwardCost, forward_cost

EXACT, APPROXIMATE = "exact", "approximate"
EXACT_RESIDUAL = 1e-6  # a filter projection's relative residual below this is float rounding: carried exactly
# the conversion whose model carry_weights can fill: one regular field per channel, mean group pooling, a basis that
# spans every filter up to 7x7 (convert_for_carrying)
CARRY_CONVERSION = {"invariant_pool": "mean", "unit_invariants": False, "basis_cutoff": 5.0}
CONVERSION_HINT = (
    "convert with convert_for_carrying(model, group), i.e. make_equivariant(model, group, width=lambda channels, "
    f"group: channels, head='invariant', config={CARRY_CONVERSION})"
)
PROBE_IMAGES = 4  # images of the default probe batch that measures the logit error


class CarryError(UnsupportedLayerError):
    """A converted model or layer whose pretrained weights cannot be carried."""


@dataclass(frozen=True)
class LayerCarry:
    """How one converted layer took its pretrained weights."""

    name: str  # its module path in the pretrained model
    status: str  # EXACT or APPROXIMATE
    residual: float  # relative Frobenius residual of its filter's projection onto the basis (0 for a copy)
    note: str


@dataclass(frozen=True)
class CarryReport:
    """What carry_weights did: each layer, the logit error against the group-averaged pretrained model, the cost."""

    group: str
    layers: tuple[LayerCarry, ...]
    logit_error: float  # max |carried - group-averaged pretrained| logit on the probe images
    logit_scale: float  # max |group-averaged pretrained| logit there, to read logit_error against
    pretrained_cost: ForwardCost  # per probe image
    carried_cost: ForwardCost

    @property
    def exact(self) -> bool:
        """Every layer carried exactly: the model computes the group average (up to float rounding)."""
        return all(layer.status == EXACT for layer in self.layers)


def _moved_filters(weight: torch.Tensor, group: GroupSpec) -> torch.Tensor:
    """(|G|, out, in, k, k): the filter moved by each grid element, in the order of a regular field's channels."""
    return torch.stack([element.act_on_grid(weight) for element in group.grid_elements])


def _copies_filter(weight: torch.Tensor, group: GroupSpec, in_size: int) -> torch.Tensor:
    """(out, in, out_size, in_size, k, k): per field pair, the block-diagonal filter that runs one copy per element."""
    moved = _moved_filters(weight.detach().double(), group).permute(1, 2, 0, 3, 4)  # (out, in, |G|, k, k)
    if in_size == 1:  # lifting: copy h reads the trivial input through its moved filter
        return moved.unsqueeze(3)
    target = moved.new_zeros(*moved.shape[:3], in_size, *moved.shape[3:])
    index = torch.arange(group.order)
    target[:, :, index, index] = moved
    return target


def _refuse(name: str, problem: str) -> CarryError:
    return CarryError(f"{name}: {problem}; {CONVERSION_HINT}")


def _carry_conv(name: str, old: nn.Module, new: SteerableConv2d, group: GroupSpec) -> LayerCarry:
    if not isinstance(old, nn.Conv2d):
        raise _refuse(name, f"a steerable convolution whose pretrained layer is a {type(old).__name__}")
    if old.groups != 1 or new.groups != 1:
        raise _refuse(name, "a grouped convolution (groups > 1) cannot be carried")
    if new.weight_standardization is not None:
        raise _refuse(name, "standardized coefficients (config weight_standardization) cannot hold given filters")
    if (new.out_fields, new.in_fields) != (old.out_channels, old.in_channels) or new.out_size != group.order:
        raise _refuse(
            name,
            f"{new.out_fields} regular fields from {new.in_fields} fields of {new.in_size} for the pretrained "
            f"{old.out_channels} from {old.in_channels} channels: each channel needs one regular field",
        )
    if old.kernel_size != (new.kernel_size, new.kernel_size) or (old.bias is None) != (new.bias is None):
        raise _refuse(
            name,
            f"kernel {old.kernel_size} bias {old.bias is not None} became {new.kernel_size} "
            f"bias {new.bias is not None}",
        )
    target = _copies_filter(old.weight, group, new.in_size).flatten(2)  # (out, in, D)
    basis = new.basis.double().flatten(1)  # (num_basis, D)
    coefficients = target @ torch.linalg.pinv(basis)
    residual = float((coefficients @ basis - target).norm() / target.norm().clamp_min(1e-30))
    with torch.no_grad():
        new.weight.copy_(coefficients.to(new.weight))
        if new.bias is not None:
            new.bias.copy_(old.bias / new.bias_scale)
    if residual < EXACT_RESIDUAL:
        return LayerCarry(name, EXACT, residual, "one filter copy per group element")
    note = f"its basis of {basis.shape[0]} filters misses part of them: raise config basis_cutoff (5.0 spans 3x3-7x7)"
    return LayerCarry(name, APPROXIMATE, residual, note)


def _carry_norm(name: str, old: nn.Module, new: FieldGroupNorm, group: GroupSpec) -> LayerCarry:
    if not isinstance(old, (nn.GroupNorm, nn.BatchNorm2d, nn.InstanceNorm2d)):
        raise _refuse(name, f"a field norm whose pretrained layer is a {type(old).__name__}")
    if old.weight is not None and new.num_fields != old.weight.numel():
        raise _refuse(name, f"{new.num_fields} fields for {old.weight.numel()} pretrained channels")
    if new.weight is not None:
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(old.bias)
    return LayerCarry(
        name, APPROXIMATE, 0.0, "affine carried; statistics pooled over each field's |G| copies, not per copy"
    )


def _carry_linear(name: str, old: nn.Module, new: nn.Linear, group: GroupSpec) -> LayerCarry:
    if (
        not isinstance(old, nn.Linear)
        or old.weight.shape != new.weight.shape
        or (old.bias is None) != (new.bias is None)
    ):
        raise _refuse(name, f"the linear layer {tuple(new.weight.shape)} has no pretrained counterpart of its shape")
    with torch.no_grad():
        new.weight.copy_(old.weight)
        if new.bias is not None:
            new.bias.copy_(old.bias)
    return LayerCarry(name, EXACT, 0.0, "copied: it maps the average of the copies' features")


# converted layer type -> how it takes its pretrained layer's weights
CARRIERS: dict[type, Callable[[str, nn.Module, nn.Module, GroupSpec], LayerCarry]] = {
    SteerableConv2d: _carry_conv,
    FieldGroupNorm: _carry_norm,
    nn.Linear: _carry_linear,
}


def _check_group(converted: EquivariantModel) -> GroupSpec:
    group = converted.group
    if not isinstance(group, GroupSpec) or len(group.grid_elements) != group.order:
        raise CarryError(
            f"group {group.name}: weights carry only for groups whose every element maps the pixel grid onto "
            "itself (C1, C2, C4, D1, D2, D4)"
        )
    return group


def _check_pooling(network: nn.Module) -> None:
    for name, module in network.named_modules():
        if isinstance(module, GroupPool) and (module.mode != "mean" or module.scale != 1.0):
            raise _refuse(name, f"group pooling {module.mode} x {module.scale:.6g} does not average the copies")


def _group_average(model: nn.Module, inputs: torch.Tensor, group: GroupSpec) -> torch.Tensor:
    return torch.stack([model(element.act_on_grid(inputs)) for element in group.grid_elements]).mean(0)


def _probe(converted: EquivariantModel, inputs: torch.Tensor | None) -> torch.Tensor:
    """The given images, or PROBE_IMAGES standard-normal images of the converted model's default input size."""
    if inputs is not None:
        return inputs
    size = converted.default_input_size()
    generator = torch.Generator().manual_seed(0)  # a fixed probe: the report is reproducible
    return torch.randn(PROBE_IMAGES, converted.in_channels, size, size, generator=generator)


def convert_for_carrying(model: nn.Module, group: str | GroupSpec, **options: Any) -> EquivariantModel:
    """`model` converted so that carry_weights can fill it (CARRY_CONVERSION, one regular field per channel, an
    invariant head); `model` itself is left as it is.

    Args:
        model: the pretrained CNN.
        group: a group of grid elements (C4, D4, ...).
        **options: further make_equivariant keywords (input_size, pad_to_valid, ...).

    Returns:
        The converted model, its parameters still to be carried.
    """
    spec = parse_group(group) if isinstance(group, str) else group
    # width kappa = |G|: floor(C * sqrt(|G| * |G|) / |G|) = C fields, a plain number that save/load can rebuild
    return make_equivariant(
        copy.deepcopy(model), spec, width=float(spec.order), head="invariant", config=dict(CARRY_CONVERSION), **options
    )


def carry_weights(
    pretrained: nn.Module, converted: EquivariantModel, inputs: torch.Tensor | None = None
) -> CarryReport:
    """Set `converted`'s parameters so that it computes the group average of `pretrained`, and measure how closely.

    `converted` must come from make_equivariant(pretrained, group, width=lambda channels, group: channels,
    head="invariant", config={"invariant_pool": "mean", "unit_invariants": False}) for a group of grid elements
    (C4, D4, ...), with a basis_cutoff large enough to span the filters (5.0 for kernels up to 7x7) for an exact carry.

    Args:
        pretrained: the trained CNN (Conv2d, GroupNorm/BatchNorm/InstanceNorm, ReLU, pooling, a Linear head); left
            as it is.
        converted: its converted model, whose parameters are overwritten.
        inputs: the images (N, C, H, W) on which the logit error is measured; None: a fixed batch of
            standard-normal images of the converted model's default input size. The pretrained model sees them
            as the converted network does: after its input fit (pad_to_valid, crop_to_valid) if it has one.

    Returns:
        A CarryReport: per layer whether it carried exactly or approximately (with the filter's residual), the
        largest logit error against the group-averaged pretrained model, and both models' cost per image.

    Raises:
        CarryError: a layer, group, width, head or group pooling the weights cannot be carried through; the
            message names the module and the conversion to use.
        UsageError: `converted` is not an EquivariantModel.
    """
    if not isinstance(converted, EquivariantModel):
        raise UsageError(
            f"converted must be the EquivariantModel make_equivariant returns, got {type(converted).__name__}"
        )
    group = _check_group(converted)
    _check_pooling(converted.network)
    originals = dict(pretrained.named_modules())
    layers: list[LayerCarry] = []
    carried: set[str] = set()
    for name, module in converted.network.named_modules():
        owns_parameters = any(True for _ in module.parameters(recurse=False))
        if not owns_parameters:
            continue
        if type(module) not in CARRIERS or name not in originals:
            raise _refuse(name, f"a {type(module).__name__} with parameters and no pretrained layer to carry from")
        layers.append(CARRIERS[type(module)](name, originals[name], module, group))
        carried.add(name)
    left = [n for n, m in originals.items() if n not in carried and any(True for _ in m.parameters(recurse=False))]
    if left:
        raise _refuse(left[0], "a pretrained layer with parameters that the converted model has no layer for")
    return CarryReport(group.name, tuple(layers), *_measure(pretrained, converted, _probe(converted, inputs), group))


def _measure(
    pretrained: nn.Module, converted: EquivariantModel, inputs: torch.Tensor, group: GroupSpec
) -> tuple[float, float, ForwardCost, ForwardCost]:
    """(logit error, logit scale, pretrained cost, carried cost), both models in eval mode (their modes restored)."""
    modes = pretrained.training, converted.training
    pretrained.eval(), converted.eval()
    try:
        fit = getattr(converted.network, FIT_MODULE, None)  # pad_to_valid / crop_to_valid: what the network sees
        with torch.no_grad():
            reference = _group_average(pretrained, inputs if fit is None else fit(inputs), group)
            error = (converted(inputs) - reference).abs().max()
        return (
            float(error),
            float(reference.abs().max()),
            forward_cost(pretrained, inputs),
            forward_cost(converted, inputs),
        )
    finally:
        pretrained.train(modes[0]), converted.train(modes[1])
