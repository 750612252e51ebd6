"""The conversion pass: trace, type every node with a rule, rewrite, analyse the grid."""

from __future__ import annotations

import contextlib
import io
import copy
import warnings
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..conversion_options import DEFAULT_MODE, HEADS, STANDARDIZATION_COORDINATES
from ..errors import NotAModuleError, ParameterError, UnsupportedLayerError
from ..groups import GroupSpec, parse_group
from ..nn.conv import standardization_scope
from ..build_recipe import conversion_recipe, remember_recipe
from ..progress import counting_basis_builds, progress_bar, require_progress
from . import rules  # noqa: F401  (registers the built-in rules)
from .context import SHAPE_KEY, SPATIAL_KEY, TYPE_KEY, ConversionConfig, ConversionContext
from .direct_sum import lift_direct_sums, lifted_output, run_rule
from .fields import FieldType
from .grid import GridAnalysis, GridBreak
from .fuse import fuse_norm_pools
from .input_channels import input_channels
from .input_fit import fit_input, invalid_size_error
from .norm_groups import norm_group_rule
from .weights import report_pretrained_weights
from .model import EquivariantModel
from .timm_api import build_equivariant_model
from .registry import find_rule
from .rules.conv import grouped_conv_multiples
from .rules.split import consistent_width
from .report import ConversionReport
from .modes import resolve_mode
from .restrict import RestrictSpec, apply_restriction, plan, stage_inputs, width_groups
from .trace import propagate_shapes, trace
from .verify import require_an_exact_size, verify_conversion
from .width import PARAMS, WidthSpec, multiplier_width, resolve_width

PROBE_SIZES = (224, 32, 28, 64, 96)  # tried in order when input_size is not given
GRID_SEARCH = range(8, 1025)
PARAMS_TOLERANCE = 0.02


def _first_line(exc: BaseException) -> str:
    """The root cause of a shape error in one line (ShapeProp wraps it with the node's whole metadata)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _traced_with_shapes(
    model: nn.Module, input_size: int | None, in_channels: int, leaves: tuple
) -> tuple[fx.GraphModule, int]:
    if input_size is not None and (isinstance(input_size, bool) or not isinstance(input_size, int) or input_size < 1):
        raise ParameterError(f"input_size must be a positive int (the side of a square input), got {input_size!r}")
    sizes = (input_size,) if input_size else PROBE_SIZES
    errors = []
    for size in sizes:
        gm = trace(model, leaves)
        try:
            # ShapeProp prints each failing node's traceback; a size the model does not take is an expected outcome
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
                propagate_shapes(gm, torch.zeros(2, in_channels, size, size))
            return gm, size
        except Exception as exc:  # shape errors of a fixed-size head
            errors.append(f"{size}: {_first_line(exc)}")
    raise UnsupportedLayerError(
        f"{type(model).__name__} does not run on a {in_channels}-channel input of size(s) {sizes} "
        f"({'; '.join(errors)}). Pass input_size= with the size the model expects."
    )


def _analyse_grid(graph: fx.Graph) -> GridAnalysis:
    """Input sizes at which every window op is symmetric and all merged branches agree; the first break at the others."""
    valid = []
    breaks: Counter[GridBreak] = Counter()
    nodes = list(graph.nodes)
    for size in GRID_SEARCH:
        first_break = _first_break(nodes, size)
        if first_break is None:
            valid.append(size)
        elif first_break is not _TOO_SMALL:
            breaks[first_break] += 1
    return GridAnalysis(valid, GRID_SEARCH[-1], dict(breaks))


_TOO_SMALL = GridBreak("", "shrinks the map to nothing")  # the input is too small: no break of equivariance


def _first_break(nodes: list[fx.Node], size: int) -> GridBreak | None:
    sizes: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op == "placeholder":
            sizes[node] = size
            continue
        ftype = node.meta.get(TYPE_KEY)
        inputs = [sizes[a] for a in node.all_input_nodes if a in sizes]
        if ftype is None or not ftype.spatial or not inputs:
            continue
        merged = set(inputs) - {1} or {1}  # 1x1 maps (squeeze-excite gates) broadcast
        if len(merged) > 1:
            return GridBreak(node.name, "merges maps of different sizes")
        op = node.meta.get(SPATIAL_KEY)
        size_in = merged.pop() if op is None else inputs[0]
        out, symmetric = op.apply(size_in) if op is not None else (size_in, True)
        if out < 1:
            return _TOO_SMALL
        if not symmetric:
            return GridBreak(node.name, "places its windows asymmetrically")
        sizes[node] = out
    return None


def _rewrite(gm: fx.GraphModule, ctx: ConversionContext, in_channels: int, bar: Any) -> FieldType | None:
    output_type = None
    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            node.meta[TYPE_KEY] = FieldType(ctx.group, "trivial", in_channels)
        elif node.op == "get_attr":
            node.meta[TYPE_KEY] = None
        elif node.op == "output":
            lift_direct_sums(ctx, node)  # a model's output is of one representation
            output_type = ctx.type_of(node.args[0])
        elif TYPE_KEY not in node.meta:  # nodes inserted by rules are typed already
            rule = find_rule(ctx, node)
            if rule is None:
                raise ctx.unsupported(node, "no conversion rule is registered for it")
            node.meta[TYPE_KEY] = run_rule(ctx, node, rule)  # direct sums lifted for rules that do not read them
        if node.name in ctx.restrictions:
            apply_restriction(ctx, lifted_output(ctx, node), ctx.restrictions[node.name])
        if bar is not None:
            bar.update(1)
    gm.graph.lint()
    gm.recompile()
    return output_type


def _prepare(model: nn.Module, input_size: int | None, leaves: tuple) -> tuple[fx.GraphModule, int]:
    in_channels = input_channels(trace(model, leaves))  # the first conv the forward runs, not the first registered
    template, _ = _traced_with_shapes(model, input_size, in_channels, leaves)
    return template, in_channels


def _convert_once(
    template: fx.GraphModule,
    in_channels: int,
    group: GroupSpec,
    width_fn,
    config: ConversionConfig,
    width_name: str,
    device: str | None = None,
    bar: Any = None,
) -> tuple[fx.GraphModule, ConversionReport, FieldType | None]:
    """Rewrite a copy of the traced template; device="meta" only counts parameters. bar: ticked per node."""
    gm = copy.deepcopy(template)
    report = ConversionReport(group=group.name, width=width_name)
    ctx = ConversionContext(gm, group, width_fn, config, report)
    ctx.field_multiples = grouped_conv_multiples(gm)
    ctx.width_fn = consistent_width(gm, width_fn, ctx.field_multiples)  # splits keep whole fields (rules/split.py)
    points = plan(gm, config.restrict, group.name)
    ctx.restrictions = {p.node: p.target for p in points}
    ctx.width_groups = width_groups(gm, points, group)
    with torch.device(device) if device else contextlib.nullcontext():
        output_type = _rewrite(gm, ctx, in_channels, bar)
    invariant_fields = bool(output_type is not None and output_type.is_invariant and not ctx.spatial_flatten)
    report.per_pixel_output = invariant_fields and _outputs_a_map(gm)  # segmentation: turns with the input
    report.invariant_output = invariant_fields and not report.per_pixel_output
    return gm, report, output_type


def _outputs_a_map(gm: fx.GraphModule) -> bool:
    """True if the traced output is a feature map of more than one pixel."""
    result = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    shape = result.meta.get(SHAPE_KEY) if isinstance(result, fx.Node) else None
    return bool(shape and len(shape) == 4 and shape[2] * shape[3] > 1)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _solve_params_width(template, in_channels, group, config, target: int) -> tuple[Any, str]:
    """The fields-per-channel multiplier whose parameter count is closest to `target`."""
    low, high = 1e-3, 1.0

    def count(multiplier: float) -> int:
        width_fn = multiplier_width(multiplier)
        return _count(_convert_once(template, in_channels, group, width_fn, config, PARAMS, "meta")[0])

    while count(high) < target:
        high *= 2
    for _ in range(20):
        middle = (low + high) / 2
        low, high = (middle, high) if count(middle) <= target else (low, middle)
    best = min((low, high), key=lambda m: abs(count(m) - target))
    return multiplier_width(best), f"{PARAMS} (multiplier {best:.4f} fields per channel)"


def _refuse_non_module(model: object) -> None:
    """make_equivariant converts a module instance; a name or a class is one step short of it."""
    if isinstance(model, nn.Module):
        return
    name = model if isinstance(model, str) else getattr(model, "__name__", None)
    if name is not None:
        name = name.split(":")[-1]
        raise NotAModuleError(
            f"make_equivariant takes a module, got {model!r}: pass one, e.g. torchvision.models.{name}(); names are "
            f"for equiconvert.create_model('torchvision:{name}')"
        )
    raise NotAModuleError(f"make_equivariant takes a torch.nn.Module, got {type(model).__name__}")


def make_equivariant(
    model: nn.Module,
    group: str | GroupSpec,
    *,
    width: WidthSpec = None,
    input_size: int | None = None,
    config: dict | ConversionConfig | None = None,
    strict: bool = False,
    head: str | None = None,
    restrict: RestrictSpec = None,
    mode: str = DEFAULT_MODE,
    frequency: int | None = None,
    pad_to_valid: bool = False,
    crop_to_valid: bool = False,
    pretrained: bool = False,
    allow_non_equivariant: bool = False,
    progress: bool | None = None,
) -> EquivariantModel:
    """Convert a CNN into a steerable CNN equivariant to `group`.

    For "SO2"/"O2", hidden fields are gated irrep fields band-limited at angular `frequency` (see
    groups.FieldLayout) and the width rules use the field size in place of |G|. Every report warning is also
    issued as a Python warning (an EquivarianceWarning).

    Args:
        model: the CNN (a torch.nn.Module with convolutions); it is left as it is.
        group: "C1".."C16", "D1".."D16", "SO2", "O2", or a GroupSpec.
        width: a name of convert/width.WIDTHS: None/"kappa" (fields = floor(C*sqrt(PAPER_KAPPA*|G|)/|G|)),
            "params" (match the original parameter count), "channels" (keep the channel count); a float kappa, or
            a callable (channels, group) -> fields.
        input_size: the image size you will use; the report says whether it keeps exact equivariance.
        config: ConversionConfig fields (head, invariant_pool, unit_invariants, weight_standardization,
            standardization_coordinates: "canonical" (default) or "escnn", the coordinates it acts on (escnn's R2Conv
            coefficients, as the paper's released code; needs the escnn extra), init_gain, basis_cutoff,
            batchnorm_groups, norm_group_rule, unit_norm_bias, leaf_modules, even_kernels: "refuse" (default) or
            "grow", which replaces a k x k conv with k even by a (k+1) x (k+1) one with the same stride and
            padding, reported per layer; fuse_norm_pools: True fuses each affine-free norm that feeds only a
            window max pool with the pool (convert/fuse.py, the same function; faster where the step is bound by
            the device, e.g. physical batches of 2048 on an H200, see the performance guide)).
        strict: turn every equivariance warning into an error.
        head: one of conversion_options.HEADS, for a head that flattens a spatial grid: "symmetric" averages the
            group-pooled grid over the group's turns and flips (invariant; the Linear still reads every cell), "invariant"
            pools globally before it, "keep" flattens the grid as it is (not invariant, reported); None: the model
            class's `equiconvert_head` if it declares one (ResNet9: "invariant"), else the mode's ("full":
            "symmetric", "dp": "keep").
        restrict: restrict the fields to a subgroup: "halved", "reflection", "invariant", a group name, a
            schedule "D8->D4->D1" (before the last stages) or {module name: step}; see convert/restrict.py. The
            model is then exactly equivariant to the last subgroup.
        mode: one of conversion_options.MODES. "full" (default): the whole group in every layer, the paper's width
            rule. "dp": the conversion that wins when the network is trained with the original DP pipeline's own
            hyper-parameters (restrict="reflection" before the last stage, or "invariant" for groups without
            flips, and width="params"); see convert/modes.py. An explicit `restrict` or `width` wins over the mode.
        frequency: the band limit of SO2/O2 fields; None for 1.
        pad_to_valid: put a symmetric zero padding to the nearest valid size in front (nn/input_fit.py), so that
            the model takes input_size and stays exact.
        crop_to_valid: the same with a symmetric crop.
        pretrained: the model holds trained weights; the report lists the layers that keep them and warns (also
            as a Python warning) that the others are freshly initialised.
        allow_non_equivariant: keep a model that no input size makes exactly equivariant (approximately
            equivariant), with a warning.
        progress: progress bars on stderr (nodes converted, kernel bases built) for a conversion longer than
            progress.DELAY_S; None shows them only when stderr is a terminal.

    Returns:
        The converted model; its `report` (a ConversionReport) describes the conversion.

    Raises:
        NotAModuleError: `model` is not a torch.nn.Module.
        InvalidInputSizeError: input_size breaks exact equivariance and neither pad_to_valid nor crop_to_valid is
            given; the message lists the nearest valid sizes.
        EquivarianceBreakError: no input size makes the model exactly equivariant (naming the nodes that break
            it) and allow_non_equivariant is False, or strict=True and the conversion warns.
        UnsupportedLayerError: a layer with no equivariant counterpart.
        ParameterError: an option out of range, or options that exclude each other.
    """
    _refuse_non_module(model)
    require_progress("make_equivariant", progress)
    if pad_to_valid and crop_to_valid:
        raise ParameterError("give pad_to_valid or crop_to_valid, not both")
    if (pad_to_valid or crop_to_valid) and input_size is None:
        raise ParameterError("pad_to_valid/crop_to_valid need the input_size to fit")
    spec = parse_group(group, frequency)
    user_restrict, user_width = restrict, width
    restrict, width, mode_options = resolve_mode(mode, spec, restrict, width)
    cfg = _make_config(config, strict, head if head is not None else default_head(model, config, mode_options.head))
    if cfg.strict and allow_non_equivariant:
        raise ParameterError("give strict or allow_non_equivariant, not both: strict refuses what the other accepts")
    if restrict is not None:
        cfg.restrict = restrict
    # one bar from the start, so that it shows once the whole conversion (tracing included) is long
    with counting_basis_builds(progress), progress_bar("converting", "node", progress) as bar:
        template, in_channels = _prepare(copy.deepcopy(model), input_size, cfg.leaf_modules)
        mode_reason = mode_options.reason
        if user_restrict is None and cfg.restrict is not None and not stage_inputs(template):
            cfg.restrict = None  # a mode's restriction needs a last stage; a model without resolution drops has none
            mode_reason += f"; no resolution drop, so no stage to restrict: {spec.name} throughout"
        bar.total = len(template.graph.nodes)  # each node rewritten, then each node of each verification run
        width_fn = resolve_width(width)
        solve_params = width_fn == PARAMS
        if solve_params:
            width_fn, width_name = _solve_params_width(template, in_channels, spec, cfg, _count(model))
        else:
            width_name = getattr(width_fn, "__name__", str(width_fn))
        gm, report, output_type = _convert_once(template, in_channels, spec, width_fn, cfg, width_name, bar=bar)
        report.params_before = _count(model)
        report.params_after = _count(gm)
        report.mode, report.mode_reason = mode, mode_reason
        off = abs(report.params_after - report.params_before) / max(report.params_before, 1)
        if solve_params and user_width is None and off > PARAMS_TOLERANCE:  # a mode's width: the closest count
            report.mode_reason += f" (the closest count fields allow is {off:.1%} off)"
        elif solve_params and off > PARAMS_TOLERANCE:
            raise UnsupportedLayerError(
                f"width='params' reached {report.params_after:,} parameters for a target of {report.params_before:,} "
                f"(more than {PARAMS_TOLERANCE:.0%} apart); pass a float kappa or a callable width instead"
            )
        grid = _analyse_grid(gm.graph)
        report.valid_input_sizes = grid.valid_sizes
        report.valid_input_rule = grid.rule()
        require_an_exact_size(gm, grid, report, allow_non_equivariant=allow_non_equivariant)
        if input_size is not None:
            report.input_size = input_size
            report.input_size_valid = grid.is_valid(input_size)
            if not report.input_size_valid and not (pad_to_valid or crop_to_valid):
                raise invalid_size_error(input_size, grid)
            if not report.input_size_valid:
                fit_input(gm, report, input_size, grid, "pad" if pad_to_valid else "crop")
        if cfg.fuse_norm_pools:
            report.fused_norm_pools = fuse_norm_pools(gm)
        _validate_no_batch_statistics(gm)
        verify_conversion(gm, template, report, in_channels, bar)  # runs where the original ran (verify.py)
    if pretrained:
        report_pretrained_weights(model, gm, report)
    converted = build_equivariant_model(model, gm, spec, in_channels, output_type, report).train(model.training)
    arguments = dict(
        group=group if isinstance(group, str) else spec.name,
        width=user_width,
        input_size=input_size,
        config=config,
        strict=strict,
        head=head,
        restrict=user_restrict,
        mode=mode,
        frequency=frequency,
        pad_to_valid=pad_to_valid,
        crop_to_valid=crop_to_valid,
        allow_non_equivariant=allow_non_equivariant,
    )
    for warning in report.warnings:
        warnings.warn(warning, stacklevel=2)
    return remember_recipe(converted, conversion_recipe(model, arguments))


def default_head(model: nn.Module, config: dict | ConversionConfig | None, mode_head: str) -> str | None:
    """The head when `head=` is not given: None where `config` chooses it, else the one the model class declares
    (`equiconvert_head`, e.g. ResNet9's "invariant"), else the mode's."""
    if isinstance(config, ConversionConfig) or (config is not None and "head" in config):
        return None
    return getattr(model, "equiconvert_head", None) or mode_head


def _make_config(config: dict | ConversionConfig | None, strict: bool, head: str | None) -> ConversionConfig:
    if isinstance(config, ConversionConfig):
        cfg = copy.copy(config)
    else:
        options = dict(config or {})
        unknown = set(options) - set(ConversionConfig.__dataclass_fields__)
        if unknown:
            raise ParameterError(
                f"unknown config keys {sorted(unknown)}; known: {sorted(ConversionConfig.__dataclass_fields__)}"
            )
        if "leaf_modules" in options:
            options["leaf_modules"] = tuple(options["leaf_modules"])
        cfg = ConversionConfig(**options)
    cfg.strict = cfg.strict or strict
    if head is not None:
        cfg.head = head
    if cfg.head not in HEADS:
        raise ParameterError(f"head must be one of {HEADS}, got {cfg.head!r}")
    norm_group_rule(cfg.norm_group_rule)  # refused by name before any layer converts, with or without norms
    standardization_scope(cfg.weight_standardization)
    if cfg.standardization_coordinates not in STANDARDIZATION_COORDINATES:
        raise ParameterError(
            f"standardization_coordinates must be one of {list(STANDARDIZATION_COORDINATES)}, "
            f"got {cfg.standardization_coordinates!r}"
        )
    return cfg


def _validate_no_batch_statistics(gm: nn.Module) -> None:
    for name, module in gm.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and (
            isinstance(module, nn.modules.batchnorm._BatchNorm) or module.track_running_stats
        ):
            raise UnsupportedLayerError(
                f"module {name!r} ({type(module).__name__}) uses batch statistics after conversion"
            )
