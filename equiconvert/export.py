"""Export a converted model to plain torch.nn layers, for deployment and ONNX.

A converted network computes its filters from coefficients and a basis at every
call and uses equiconvert's own norm and pooling modules. `export` replaces each
of them by standard torch layers computing the same outputs, so the result runs
(and unpickles) without equiconvert and maps onto standard ONNX operators.

The exported layers hold the expanded, *untied* weights: good for inference,
but training them further leaves the equivariant subspace.

Exporters live in a registry (`EXPORTERS`, filled by `@register_exporter`),
keyed by exact module type as the conversion rules are (a subclass may override
forward, so it needs its own exporter).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.nn.utils import skip_init

from .adapt.canonicalize import CanonicalizedModel, canonical_pose, pose_scores, straight_through_choice
from .convert.model import EquivariantModel
from .convert.timm_api import TimmEquivariantModel
from .errors import CallOrderError, UnsupportedLayerError
from .nn.norm import normalize_field_groups
from .nn.pooling import NORM_POOL_EPS, REDUCTIONS
from .nn import (
    FieldGroupNorm,
    FieldGroupNormMaxPool2d,
    FieldRestriction,
    GatedNonlinearity,
    GridSymmetrize,
    GroupPool,
    GroupStandardization,
    InputFit,
    InvariantMap,
    NormMaxPool2d,
    ReflectionRestriction,
    SteerableConv2d,
    WindowMaxPool2d,
)
from .nn.conv_transpose import SteerableConvTranspose2d
from .nn.direct_sum import DirectSumConv2d, FieldLift
from .nn.input_fit import apply_fit

__all__ = ["EXPORTERS", "ExportContext", "Exporter", "export", "register_exporter"]


@dataclass
class ExportContext:
    """What an exporter may need beyond the module itself."""

    path: str  # dotted path of the module in the model being exported ("" for the root)
    input_ndim: int | None = None  # rank of the module's input, when a traced graph records it
    _recurse: Callable[[nn.Module, str], nn.Module] | None = field(default=None, repr=False)

    def export_child(self, module: nn.Module, name: str) -> nn.Module:
        """Export a module that a wrapper exporter returns in place of itself."""
        if self._recurse is None:
            raise CallOrderError("export_child needs the context that export() passes to exporters")
        return self._recurse(module, _join(self.path, name))


Exporter = Callable[[nn.Module, ExportContext], nn.Module]
EXPORTERS: dict[type, Exporter] = {}


def register_exporter(*module_types: type) -> Callable[[Exporter], Exporter]:
    """Register `exporter(module, ctx) -> torch-only module` for these exact module types."""

    def decorate(exporter: Exporter) -> Exporter:
        for module_type in module_types:
            EXPORTERS[module_type] = exporter
        return exporter

    return decorate


def export(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with every equiconvert module replaced by plain torch layers.

    Outputs are bit-identical, except after GroupPool in 'mean' or 'norm' mode,
    whose torch pooling layers round differently (about 1e-7 relative).

    Args:
        model: a converted model (an EquivariantModel exports to its network, a GraphModule, not the wrapper).

    Returns:
        The plain torch copy; `model` is left as it is.

    Raises:
        UnsupportedLayerError: an equiconvert module has no exporter; the message names its module path.
    """
    exported = _Exporter().run(copy.deepcopy(model))
    for module in exported.modules():
        if isinstance(module, fx.GraphModule):
            _scrub_graph_module(module)
    return exported


# --- the walk ------------------------------------------------------------------


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_equiconvert(obj: object) -> bool:
    return type(obj).__module__.split(".")[0] == __name__.split(".")[0]


def _describe_path(path: str) -> str:
    return repr(path) if path else "<root>"


class _Exporter:
    """Replaces modules of a private copy bottom-up; shared modules are exported once."""

    def __init__(self) -> None:
        self.memo: dict[int, nn.Module] = {}
        self.ranks: dict[str, set[int | None]] = {}

    def run(self, module: nn.Module, path: str = "") -> nn.Module:
        if id(module) in self.memo:
            return self.memo[id(module)]
        exporter = EXPORTERS.get(type(module))
        if exporter is not None:
            ranks = self.ranks.get(path, set())
            ctx = ExportContext(path, next(iter(ranks)) if len(ranks) == 1 else None, self.run)
            new = exporter(module, ctx)
            _check_torch_only(new, path, type(module))
            new.train(module.training)
        elif _is_equiconvert(module):
            cls = type(module)
            raise UnsupportedLayerError(
                f"cannot export module {_describe_path(path)} ({cls.__module__}.{cls.__qualname__}): no exporter is "
                f"registered for it. Register one with `@register_exporter({cls.__name__})` from equiconvert.export, "
                "returning plain torch.nn modules with the same outputs."
            )
        else:
            if isinstance(module, fx.GraphModule):
                self._record_input_ranks(module, path)
            for name, child in list(module.named_children()):
                new_child = self.run(child, _join(path, name))
                if new_child is not child:
                    setattr(module, name, new_child)
            new = module
        self.memo[id(module)] = new
        return new

    def _record_input_ranks(self, gm: fx.GraphModule, path: str) -> None:
        """Input rank of every called submodule, from the shapes a ShapeProp left in node.meta."""
        for node in gm.graph.nodes:
            if node.op == "call_module":
                arg = node.args[0] if node.args else None
                self.ranks.setdefault(_join(path, str(node.target)), set()).add(_rank(arg))


def _rank(arg: object) -> int | None:
    if not isinstance(arg, fx.Node):
        return None
    meta = arg.meta.get("tensor_meta", arg.meta.get("val"))
    shape = getattr(meta, "shape", None)
    return len(shape) if shape is not None else None


def _check_torch_only(module: nn.Module, path: str, source: type) -> None:
    for name, sub in module.named_modules():
        if _is_equiconvert(sub):
            raise UnsupportedLayerError(
                f"the exporter for {source.__name__} at {_describe_path(path)} returned a module containing "
                f"{type(sub).__name__} (at {_describe_path(_join(path, name))}); "
                "exporters must return torch-only modules"
            )


def _scrub_graph_module(gm: fx.GraphModule) -> None:
    """Drop equiconvert objects that GraphModules carry besides their modules.

    The converter's tracer class would otherwise be pickled with the model (and
    needed to unpickle it), and node.meta holds equiconvert field types.
    """
    for owner in (gm, gm.graph):
        tracer_cls = getattr(owner, "_tracer_cls", None)
        if tracer_cls is not None and tracer_cls.__module__.split(".")[0] == __name__.split(".")[0]:
            owner._tracer_cls = None
    for node in gm.graph.nodes:
        for key in [k for k, v in node.meta.items() if k.startswith("equiconvert") or _is_equiconvert(v)]:
            del node.meta[key]


def _trace_torch_only(module: nn.Module, class_name: str) -> fx.GraphModule:
    """symbolic_trace `module` (defined here, calling only torch) into a GraphModule.

    The GraphModule copies just the tensors the graph reads, so the result is a
    torch.fx class with torch ops: the helper class defined here does not survive.
    """
    return fx.GraphModule(module, fx.Tracer().trace(module), class_name=class_name)


def _parameter(value: torch.Tensor, source: torch.Tensor) -> nn.Parameter:
    """`value` (a fresh tensor, not copied again) as a Parameter that is trainable iff `source` is."""
    return nn.Parameter(value.detach().contiguous(), source.requires_grad)


# --- exporters ------------------------------------------------------------------


@register_exporter(EquivariantModel, TimmEquivariantModel)
def export_equivariant_model(module: EquivariantModel, ctx: ExportContext) -> nn.Module:
    """The wrapper only carries metadata; deployment needs just its network."""
    return ctx.export_child(module.network, "network")


class _CanonicalizedOps(nn.Module):
    """CanonicalizedModel's forward without its input checks (a shape comparison does not trace)."""

    def __init__(self, module: CanonicalizedModel, canonicalizer: nn.Module, backbone: nn.Module) -> None:
        super().__init__()
        self.canonicalizer, self.backbone = canonicalizer, backbone
        self.order, self.temperature, self.elements = module.group.order, module.temperature, module.elements
        self.reach = module.reach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = pose_scores(self.canonicalizer, x, self.order, self.reach)
        choice = straight_through_choice(scores, self.temperature)
        return self.backbone(canonical_pose(x, choice, self.elements))


class _ChildrenAsLeaves(fx.Tracer):
    """Traces a wrapper's own operations and calls its (exported, possibly untraceable) children as they are."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return "." not in qualified_name or super().is_leaf_module(module, qualified_name)


@register_exporter(CanonicalizedModel)
def export_canonicalized_model(module: CanonicalizedModel, ctx: ExportContext) -> nn.Module:
    """The canonicaliser and the backbone exported, and the pose choice (argmax, turns, flips) as torch ops."""
    canonicalizer = ctx.export_child(module.canonicalizer, "canonicalizer")
    backbone = ctx.export_child(module.backbone, "backbone")
    ops = _CanonicalizedOps(module, canonicalizer, backbone)
    return fx.GraphModule(ops, _ChildrenAsLeaves().trace(ops), class_name="Canonicalized")


class _InputFitOps(nn.Module):
    """InputFit's operations without its input-size check (a shape comparison does not trace)."""

    def __init__(self, fit: InputFit) -> None:
        super().__init__()
        self.grow, self.border, self.centre_line = fit.grow, fit.border, fit.centre_line
        self.register_buffer("line_a", fit.line_a.clone(), persistent=False)
        self.register_buffer("line_b", fit.line_b.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_fit(self, x)


@register_exporter(InputFit)
def export_input_fit(module: InputFit, ctx: ExportContext) -> nn.Module:
    """The same padding/cropping and centre lines as torch ops (index_select, pad, slicing)."""
    return _trace_torch_only(_InputFitOps(module), "InputFit")


@register_exporter(SteerableConvTranspose2d)
def export_steerable_conv_transpose(module: SteerableConvTranspose2d, ctx: ExportContext) -> nn.ConvTranspose2d:
    """nn.ConvTranspose2d with the expanded filter in its (in, out/groups, k, k) layout."""
    with torch.no_grad():
        weight, bias = module.transposed_filter().detach(), module.expand_bias()
    conv = skip_init(  # no random init: the weights are overwritten at once
        nn.ConvTranspose2d,
        module.in_channels,
        module.out_channels,
        module.kernel_size,
        stride=module.stride,
        padding=module.padding,
        output_padding=module.output_padding,
        groups=module.groups,
        bias=bias is not None,
        dilation=module.dilation,
        device=weight.device,
        dtype=weight.dtype,
    )
    conv.weight = _parameter(weight, module.weight)
    if bias is not None:
        conv.bias = _parameter(bias, module.bias)
    return conv


@register_exporter(DirectSumConv2d)
def export_direct_sum_conv(module: DirectSumConv2d, ctx: ExportContext) -> nn.Conv2d:
    """nn.Conv2d with the parts' filters side by side along the input channels."""
    with torch.no_grad():
        weight, bias = module.expand_filter().detach(), module.expand_bias()
    conv = skip_init(  # no random init: the weights are overwritten at once
        nn.Conv2d,
        module.in_channels,
        module.out_channels,
        module.kernel_size,
        stride=module.stride,
        padding=module.padding,
        dilation=module.dilation,
        bias=bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    conv.weight = _parameter(weight, module.weight(0, 0))
    if bias is not None:
        conv.bias = _parameter(bias, module.bias_0)
    return conv


@register_exporter(SteerableConv2d)
def export_steerable_conv(module: SteerableConv2d, ctx: ExportContext) -> nn.Conv2d:
    """nn.Conv2d with the expanded filter: the basis expansion is a constant at inference.

    nn.Conv2d takes the same stride/padding/dilation/groups/padding_mode arguments,
    string paddings ('same'/'valid') included, also with non-zero padding modes.
    """
    with torch.no_grad():
        weight, bias = module.expand_filter().detach(), module.expand_bias()
    conv = skip_init(  # no random init: the weights are overwritten at once
        nn.Conv2d,
        module.in_channels,
        module.out_channels,
        module.kernel_size,
        stride=module.stride,
        padding=module.padding,
        dilation=module.dilation,
        groups=module.groups,
        bias=bias is not None,
        padding_mode=module.padding_mode,
        device=weight.device,
        dtype=weight.dtype,
    )
    conv.weight = _parameter(weight, module.weight)
    if bias is not None:
        conv.bias = _parameter(bias, module.bias)
    return conv


class _FieldGroupNormOps(nn.Module):
    """FieldGroupNorm in plain torch ops; only ever used traced.

    Normalises with an nn.GroupNorm(affine=False) submodule when the groups are
    even (FieldGroupNorm calls the same F.group_norm), else with normalize_field_groups,
    traced into its torch ops: the forward ops FieldGroupNorm._standardize runs
    (inside an autograd.Function that only replaces the backward). The per-field
    affine step is the same separate multiply and add, on the (batch, field, rest)
    view so that it works at any rank: bit-identical outputs, and weight/bias stay
    per field.
    """

    def __init__(self, norm: FieldGroupNorm) -> None:
        super().__init__()
        self.num_fields, self.eps = norm.num_fields, norm.eps
        self.even = norm.num_fields % norm.num_groups == 0
        if self.even:
            self.norm = nn.GroupNorm(norm.num_groups, norm.num_fields * norm.field_size, norm.eps, affine=False)
        else:
            to_groups, to_fields = norm.group_maps()  # held as named buffers (not traced constants)
            self.register_buffer("to_groups", to_groups.detach())
            self.register_buffer("to_fields", to_fields.detach().clone())  # clone keeps the transposed strides
        self.weight = None if norm.weight is None else _parameter(norm.weight.clone(), norm.weight)
        self.bias = None if norm.bias is None else _parameter(norm.bias.clone(), norm.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.even:
            fields = self.norm(x).unflatten(1, (self.num_fields, -1)).flatten(2)  # also for 0 samples
        else:
            fields = x.unflatten(1, (self.num_fields, -1)).flatten(2)
            fields = normalize_field_groups(fields, self.to_groups, self.to_fields, self.eps)
        if self.weight is not None:
            fields = fields * self.weight.unsqueeze(-1) + self.bias.unsqueeze(-1)
        return fields.reshape(x.shape)


@register_exporter(FieldGroupNorm)
def export_field_group_norm(module: FieldGroupNorm, ctx: ExportContext) -> nn.Module:
    """nn.GroupNorm(affine=False) if that is all it is, else a traced torch-only GraphModule.

    Even groups with affine parameters are not folded into nn.GroupNorm(affine=True)
    with repeated weights: its kernel fuses the affine step, which changes float
    rounding, and deep networks amplify that past 1e-6 relative (6e-6 on timm's
    resnet50d). Uneven groups have no torch layer at all. So both become
    symbolic_trace of a pure-torch module defined here (_FieldGroupNormOps),
    re-homed by fx into a GraphModule with only torch classes.
    """
    if module.weight is None and module.num_fields % module.num_groups == 0:
        return nn.GroupNorm(module.num_groups, module.num_fields * module.field_size, module.eps, affine=False)
    return _trace_torch_only(_FieldGroupNormOps(module), "FieldGroupNormOps")


_POOLS = {
    "max": {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d},
    "mean": {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d},
}
_LP_POOLS = {1: nn.LPPool1d, 2: nn.LPPool2d, 3: nn.LPPool3d}
_CONSTANT_PADS = {1: nn.ConstantPad1d, 2: nn.ConstantPad2d, 3: nn.ConstantPad3d}


class _FieldReduce(nn.Module):
    """GroupPool in rank-agnostic torch ops; only ever used traced."""

    def __init__(self, num_fields: int, field_size: int, mode: str) -> None:
        super().__init__()
        self.num_fields, self.field_size, self.mode = num_fields, field_size, mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return REDUCTIONS[self.mode](x.unflatten(1, (self.num_fields, self.field_size)))


class _Scaled(nn.Module):
    """`inner` times a constant; only ever used traced."""

    def __init__(self, inner: nn.Module, scale: float) -> None:
        super().__init__()
        self.inner, self.scale = inner, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


@register_exporter(GroupPool)
def export_group_pool(module: GroupPool, ctx: ExportContext) -> nn.Module:
    """The reduction below, then its scale (a traced multiplication) where it is not 1."""
    reduction = _export_reduction(module, ctx)
    return reduction if module.scale == 1.0 else _trace_torch_only(_Scaled(reduction, module.scale), "ScaledGroupPool")


def _export_reduction(module: GroupPool, ctx: ExportContext) -> nn.Module:
    """Unflatten(1, (fields, size)) + a pool over the new field-size dim + Flatten(1, 2).

    For an input of rank n, the unflattened tensor has n - 1 pooled dims (field
    size, then the spatial dims), so (B,C) uses the 1d pools and (B,C,H,W) the 3d
    ones, with kernel (size, 1, ...). 'norm' is LPPool(2) over the field plus one
    padded slot of value sqrt(NORM_POOL_EPS): that adds GroupPool's epsilon under the root,
    so zero fields give 1e-6 (not 0) and gradients stay finite, as in GroupPool.
    When the input rank is unknown (no traced shapes), a traced pure-torch
    reduction replaces it instead.
    """
    fields, size = module.num_fields, module.field_size
    dims = None if ctx.input_ndim is None else ctx.input_ndim - 1
    if dims not in (1, 2, 3):
        return _trace_torch_only(_FieldReduce(fields, size, module.mode), "FieldReduce")

    def kernel(length: int) -> int | tuple[int, ...]:
        return (length,) + (1,) * (dims - 1) if dims > 1 else length

    if module.mode == "norm":
        padding = (0, 0) * (dims - 1) + (0, 1)  # last dim first: one slot at the end of the field-size dim
        eps_slot = _CONSTANT_PADS[dims](padding, NORM_POOL_EPS**0.5)
        pool: list[nn.Module] = [eps_slot, _LP_POOLS[dims](2, kernel(size + 1))]
    else:
        pool = [_POOLS[module.mode][dims](kernel(size))]
    return nn.Sequential(nn.Unflatten(1, (fields, size)), *pool, nn.Flatten(1, 2))


class _ChannelSelect(nn.Module):
    """x.index_select(1, index) with the index as a named buffer; only ever used traced."""

    def __init__(self, index: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("index", index.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_select(1, self.index)


@register_exporter(FieldRestriction, FieldLift)
def export_field_restriction(module: FieldRestriction | FieldLift, ctx: ExportContext) -> nn.Module:
    """A traced channel selection (index_select): a restriction is a fixed change of basis, a lift fixed copies."""
    return _trace_torch_only(_ChannelSelect(module.index), "ChannelSelect")


class _GroupStandardizationOps(nn.Module):
    """GroupStandardization's forward without its autocast guard, which symbolic tracing cannot follow."""

    def __init__(self, layer: GroupStandardization) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.normalize(x)


@register_exporter(GroupStandardization)
def export_group_standardization(module: GroupStandardization, ctx: ExportContext) -> nn.Module:
    """Traced like the field layers below, from the same ops (the guard only matters under autocast)."""
    return _trace_torch_only(_GroupStandardizationOps(module), "GroupStandardizationOps")


@register_exporter(GatedNonlinearity, NormMaxPool2d, InvariantMap, ReflectionRestriction)
def export_irrep_field_layer(module: nn.Module, ctx: ExportContext) -> nn.Module:
    """SO(2)/O(2) field layers and the O(2) -> D1 restriction: their forward is torch ops on buffers
    and torch submodules only, so symbolic tracing re-homes it into a GraphModule of torch classes
    (same ops, same outputs)."""
    return _trace_torch_only(module, type(module).__name__ + "Ops")


@register_exporter(GridSymmetrize)
def export_grid_symmetrize(module: GridSymmetrize, ctx: ExportContext) -> nn.Module:
    """Its flips, quarter turns and mean are torch ops already: traced into a GraphModule of torch classes."""
    return _trace_torch_only(module, "GridSymmetrizeOps")


@register_exporter(FieldGroupNormMaxPool2d)
def export_field_group_norm_max_pool(module: FieldGroupNormMaxPool2d, ctx: ExportContext) -> nn.Module:
    """The norm and the plain max pool it fuses, one after the other."""
    kernel = module.kernel_size
    return nn.Sequential(ctx.export_child(module.norm, "norm"), nn.MaxPool2d(kernel, kernel))


@register_exporter(WindowMaxPool2d)
def export_window_max_pool(module: WindowMaxPool2d, ctx: ExportContext) -> nn.Module:
    """The plain max pool it computes: only its backward differs."""
    return nn.MaxPool2d(module.kernel_size, module.stride)
