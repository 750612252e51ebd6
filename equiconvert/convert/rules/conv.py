"""nn.Conv2d -> SteerableConv2d."""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch import nn

from ...conversion_options import ESCNN_COORDINATES
from ...errors import ParameterError
from ...basis import steerable_basis
from ...nn.conv import standardization_scope
from ...groups import GroupSpec
from ...nn import SteerableConv2d
from ...nn.direct_sum import DirectSumConv2d
from ..context import ConversionContext
from ..direct_sum import lift_direct_sums
from ..fields import FieldSum, FieldType
from ..grid import WindowOp
from ..registry import is_classifier_conv, register_module_rule, takes_direct_sums


def _square(node: fx.Node, ctx: ConversionContext, name: str, value: tuple[int, int]) -> int:
    if value[0] != value[1]:
        raise ctx.unsupported(node, f"{name}={value} is not square; rotations swap height and width")
    return value[0]


def _padding(ctx: ConversionContext, node: fx.Node, conv: nn.Conv2d, kernel: int, dilation: int) -> tuple[int, object]:
    """(symmetric padding used for grid analysis, padding argument of the steerable conv)."""
    if isinstance(conv.padding, str):
        numeric = 0 if conv.padding == "valid" else dilation * (kernel - 1) // 2
        return numeric, numeric
    if conv.padding[0] != conv.padding[1]:
        ctx.warn(node, f"padding={conv.padding} differs between height and width: rotations do not map it onto itself")
    return conv.padding[0], conv.padding


def _output_fields(ctx: ConversionContext, node: fx.Node, conv: nn.Conv2d, t_in: FieldType) -> tuple[int, int]:
    """(output fields, groups) of the steerable conv."""
    if conv.groups == 1:
        return ctx.fields_for(conv.out_channels, t_in.group), 1
    if conv.groups == conv.in_channels:  # depthwise per channel -> depthwise per field
        return t_in.num_fields * (conv.out_channels // conv.in_channels), t_in.num_fields
    out_fields = ctx.fields_for(conv.out_channels, t_in.group)
    if t_in.num_fields % conv.groups or out_fields % conv.groups:  # width policy ignored the constraint
        raise ctx.unsupported(
            node,
            f"groups={conv.groups} does not divide the {t_in.num_fields} input / {out_fields} output fields",
            "Options: pass width= as a callable that returns multiples of the group count, or use groups=1.",
        )
    return out_fields, conv.groups


EVEN_KERNEL_POLICIES = ("refuse", "grow")
RESIDUAL_SUMS = (operator.add, operator.iadd, torch.add, "add", "add_")


def _grown_kernel(ctx: ConversionContext, node: fx.Node, kernel: int) -> int:
    """The odd kernel replacing an even one under even_kernels="grow", else a clear error.

    With the same stride and padding, a (k+1) x (k+1) window at input size H+1 spans what the k x k one
    spans at H: the output sizes agree and the windows are symmetric at the sizes that shift by one.
    """
    policy = ctx.config.even_kernels
    if policy not in EVEN_KERNEL_POLICIES:
        raise ParameterError(f"even_kernels must be one of {EVEN_KERNEL_POLICIES}, got {policy!r}")
    if policy == "refuse":
        raise ctx.unsupported(
            node,
            f"even kernel_size={kernel}: its centre lies between pixels, so no equivariant filter exists on the grid",
            "Options: pass config={'even_kernels': 'grow'} to use a (k+1)x(k+1) kernel with the same stride and "
            "padding, or use an odd kernel before converting.",
        )
    ctx.record(node, f"kernel {kernel}x{kernel}", f"kernel {kernel + 1}x{kernel + 1} (even_kernels='grow')")
    return kernel + 1


@register_module_rule(nn.Conv2d)
@takes_direct_sums
def convert_conv2d(ctx: ConversionContext, node: fx.Node) -> FieldType:
    conv: nn.Conv2d = ctx.module(node)
    if conv.groups != 1 or conv.padding_mode != "zeros" or standardization_scope(ctx.config.weight_standardization):
        lift_direct_sums(ctx, node)  # one basis per part: plain convolutions only (nn/direct_sum.DirectSumConv2d)
    return convert_conv(ctx, node, ctx.config.weight_standardization, same_padding=False)


def convert_conv(ctx: ConversionContext, node: fx.Node, weight_standardization: bool, same_padding: bool) -> FieldType:
    """Any nn.Conv2d subclass; same_padding: TensorFlow-style 'SAME' padding, symmetric where the grid is exact."""
    conv: nn.Conv2d = ctx.module(node)
    t_in = ctx.field_input(node)
    if conv.in_channels != ctx.shape(node.args[0])[1]:
        raise ctx.unsupported(node, "in_channels does not match the traced input")
    kernel = _square(node, ctx, "kernel_size", conv.kernel_size)
    stride = _square(node, ctx, "stride", conv.stride)
    dilation = _square(node, ctx, "dilation", conv.dilation)
    if kernel % 2 == 0:
        kernel = _grown_kernel(ctx, node, kernel)
    if same_padding:  # TF 'SAME' pads (d(k-1) - (H-1) % s) in total: d(k-1)/2 a side at the sizes the grid needs
        grid_padding = padding_arg = dilation * (kernel - 1) // 2
    else:
        grid_padding, padding_arg = _padding(ctx, node, conv, kernel, dilation)
    partner = residual_partner(ctx, node) if conv.groups == 1 else None
    if isinstance(partner, FieldSum) and (
        standardization_scope(weight_standardization) or conv.padding_mode != "zeros"
    ):
        partner = None  # DirectSumConv2d neither standardizes nor pads but with zeros: the sum is refused, naming it
    if is_classifier_conv(ctx, node) and conv.groups == 1 or isinstance(partner, FieldType):
        out_repr, (out_fields, groups) = "trivial", (conv.out_channels, 1)
    else:
        out_repr, (out_fields, groups) = t_in.group.hidden_repr, _output_fields(ctx, node, conv, t_in)
    if isinstance(t_in, FieldSum) or partner is not None and not isinstance(partner, FieldType):
        out_type = partner if isinstance(partner, FieldSum) else FieldType(t_in.group, out_repr, out_fields)
        in_parts = t_in.parts if isinstance(t_in, FieldSum) else (t_in,)
        out_parts = out_type.parts if isinstance(out_type, FieldSum) else (out_type,)
        cutoff = ctx.config.basis_cutoff
        new = DirectSumConv2d(
            [
                [steerable_basis(p.group, p.representation, q.representation, kernel, cutoff=cutoff) for p in in_parts]
                for q in out_parts
            ],
            [p.num_fields for p in in_parts],
            [q.num_fields for q in out_parts],
            stride=stride,
            padding=padding_arg,
            dilation=dilation,
            bias=conv.bias is not None,
            init_gain=ctx.config.init_gain,
            bias_scale=bias_scale(ctx, t_in.group, out_repr),
        )
        ctx.replace_module(node, new)
        ctx.set_spatial(node, WindowOp(kernel, stride, grid_padding, dilation))
        return out_type
    basis = steerable_basis(t_in.group, t_in.representation, out_repr, kernel, cutoff=ctx.config.basis_cutoff)
    new = SteerableConv2d(
        basis,
        t_in.num_fields,
        out_fields,
        stride=stride,
        padding=padding_arg,
        dilation=dilation,
        groups=groups,
        bias=conv.bias is not None,
        padding_mode=conv.padding_mode,
        weight_standardization=weight_standardization,
        standardization_coordinates=standardization_coordinates(
            ctx, weight_standardization, t_in.group, t_in.representation, out_repr, kernel
        ),
        init_gain=ctx.config.init_gain,
        bias_channels=t_in.group.bias_channels(out_repr),
        bias_scale=bias_scale(ctx, t_in.group, out_repr),
    )
    ctx.replace_module(node, new)
    ctx.set_spatial(node, WindowOp(kernel, stride, grid_padding, dilation))
    return FieldType(t_in.group, out_repr, out_fields)


def residual_partner(ctx: ConversionContext, node: fx.Node) -> "FieldType | FieldSum | None":
    """The type of a map the conv's map is added to (through ops that keep its shape), where the conv must
    produce that type for the sum to be of one: trivial fields (a residual on the image itself) or a direct sum
    (a residual on the image concatenated beside features); None otherwise."""
    for user in node.users:
        others = [ctx.type_of(a) for a in user.all_input_nodes if a is not node]
        if user.target in RESIDUAL_SUMS:
            for t in others:
                if isinstance(t, FieldSum) or t is not None and t.representation == "trivial" and t.spatial:
                    return t
        elif not others and ctx.shape(user) == ctx.shape(node) and not _is_layer(ctx, user):
            found = residual_partner(ctx, user)
            if found is not None:
                return found
    return None


def _is_layer(ctx: ConversionContext, node: fx.Node) -> bool:
    """A layer with weights: its output is a new map, whatever its shape."""
    return node.op == "call_module" and isinstance(ctx.module(node), (nn.Conv2d, nn.ConvTranspose2d, nn.Linear))


def grouped_conv_multiples(gm) -> dict[int, int]:
    """Channel count -> multiple of `groups` that its field count must be, from every grouped conv."""
    multiples: dict[int, int] = {}
    for module in gm.modules():
        if type(module) is nn.Conv2d and 1 < module.groups < module.in_channels:
            for channels in (module.in_channels, module.out_channels):
                multiples[channels] = math.lcm(multiples.get(channels, 1), module.groups)
    return multiples


def standardization_coordinates(
    ctx: ConversionContext,
    weight_standardization: bool | str,
    group: GroupSpec,
    in_repr: str,
    out_repr: str,
    kernel: int,
) -> torch.Tensor | None:
    """SteerableConv2d's standardization_coordinates: escnn's where the config asks for them and the layer
    standardizes, else None (the canonical basis' own)."""
    if (
        ctx.config.standardization_coordinates != ESCNN_COORDINATES
        or standardization_scope(weight_standardization) is None
    ):
        return None
    from ...bases.escnn_reference import escnn_coordinates

    return escnn_coordinates(group, in_repr, out_repr, kernel, cutoff=ctx.config.basis_cutoff)


def bias_scale(ctx: ConversionContext, group: GroupSpec, out_repr: str) -> float:
    """SteerableConv2d's bias_scale: 1/sqrt(field size) under unit_norm_bias where one bias covers a whole field
    (trivial and regular fields; irrep fields' biases sit on single trivial channels already), else 1."""
    if not ctx.config.unit_norm_bias or group.bias_channels(out_repr) is not None:
        return 1.0
    return group.repr_size(out_repr) ** -0.5
