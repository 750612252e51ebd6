"""State shared by the conversion rules while they rewrite one traced graph."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx
from torch import nn

from ..conversion_options import CANONICAL_COORDINATES, KEEP_HEAD
from ..errors import EquivarianceBreakError, ParameterError, UnsupportedLayerError
from ..groups import GroupSpec
from .fields import FieldType
from .grid import SpatialOp
from .report import ConversionReport, EquivarianceWarning, LayerChange

TYPE_KEY = "equiconvert_type"
SPATIAL_KEY = "equiconvert_spatial"
SHAPE_KEY = "equiconvert_shape"


@dataclass
class ConversionConfig:
    """Options of one conversion; see make_equivariant for their meaning."""

    head: str = KEEP_HEAD  # one of HEADS
    invariant_pool: str = "max"  # group pooling before the classifier
    unit_invariants: bool = True  # group pooling scaled to keep the original's signal scale (nn/pooling.unit_scale)
    weight_standardization: bool | str = False  # True = "field"; "layer": the released code's (nn/conv.py)
    # what weight_standardization acts on, STANDARDIZATION_COORDINATES: "escnn" as the released code
    standardization_coordinates: str = CANONICAL_COORDINATES
    init_gain: float = math.sqrt(2.0)  # steerable filters start with std gain/sqrt(fan-in); 1 = escnn's scale
    unit_norm_bias: bool = False  # a field's bias added as bias/sqrt(field size) per channel, as escnn's R2Conv
    basis_cutoff: float | None = None  # band limit c*r per ring; None = escnn's default (3.0 = paper's code)
    restrict: Any = None  # see convert/restrict.py
    batchnorm_groups: int = 32  # BatchNorm2d becomes a field-aligned GroupNorm with this many groups
    norm_group_rule: str = "at_most"  # a norm's groups from its fields and the groups asked (convert/norm_groups.py)
    strict: bool = False
    leaf_modules: tuple[type, ...] = ()
    even_kernels: str = "refuse"  # "grow": a k x k conv with k even becomes (k+1) x (k+1), same stride and padding
    fuse_norm_pools: bool = False  # convert/fuse.py: norm -> window max pool pairs as one layer (same function)


class ConversionContext:
    def __init__(
        self,
        gm: fx.GraphModule,
        group: GroupSpec,
        width_fn: Callable[[int, GroupSpec], int],
        config: ConversionConfig,
        report: ConversionReport,
    ) -> None:
        self.gm, self.group, self.width_fn, self.config, self.report = gm, group, width_fn, config, report
        self._counter = 0
        self.field_multiples: dict[int, int] = {}  # channel count -> multiple its field count must be
        self.spatial_flatten = False  # set by a head that flattens a grid
        self.restrictions: dict[str, Any] = {}  # tensor node name -> restriction step applied after it
        self.width_groups: dict[int, GroupSpec] = {}  # channel count -> group that sizes its fields

    # --- reading the graph -------------------------------------------------
    def type_of(self, arg: Any) -> FieldType | None:
        return arg.meta.get(TYPE_KEY) if isinstance(arg, fx.Node) else None

    def field_input(self, node: fx.Node, index: int = 0) -> FieldType:
        arg = node.args[index] if index < len(node.args) else None
        ftype = self.type_of(arg)
        if ftype is None:
            raise self.unsupported(node, "its input is not a feature tensor that equiconvert could type")
        return ftype

    def shape(self, node: fx.Node) -> tuple[int, ...] | None:
        return node.meta.get(SHAPE_KEY)

    def module(self, node: fx.Node) -> nn.Module:
        return self.gm.get_submodule(node.target)

    @staticmethod
    def module_path(node: fx.Node) -> str:
        """The module that `node` calls, or the innermost one whose forward created it ("" if none)."""
        if node.op == "call_module":
            return str(node.target)
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            last = list(stack.values())[-1]
            return str(last[0] if isinstance(last, tuple) else last)
        return ""

    @staticmethod
    def source_line(node: fx.Node) -> str:
        """File and line of the model code that created `node` (tracer frames skipped)."""
        trace = node.stack_trace or node.meta.get("stack_trace") or ""
        frames = [f for f in re.findall(r'File "([^"]+)", line (\d+)', trace) if not _is_torch_internal(f[0])]
        return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""

    def fields_for(self, channels: int, group: GroupSpec | None = None) -> int:
        """Fields for a layer of `channels` channels: the width policy, rounded up to what grouped convs need.

        The group that sizes a width is the one its last layer runs in (see restrict.width_groups).
        """
        group = self.width_groups.get(channels, group or self.group)
        fields = int(self.width_fn(channels, group))
        if fields < 1:
            raise ParameterError(f"width: the width policy returned {fields} fields for {channels} channels; need >= 1")
        multiple = self.field_multiples.get(channels, 1)
        return max(multiple, round(fields / multiple) * multiple)

    # --- rewriting ---------------------------------------------------------
    def replace_module(self, node: fx.Node, new: nn.Module, before: nn.Module | None = None) -> None:
        old = before if before is not None else self.module(node)
        parent_name, _, child = str(node.target).rpartition(".")
        parent = self.gm.get_submodule(parent_name) if parent_name else self.gm
        setattr(parent, child, new)
        self.record(node, _describe(old), _describe(new))

    def record(self, node: fx.Node, before: str, after: str) -> None:
        self.report.layers.append(LayerChange(node.name, self.module_path(node), before, after))

    def _insert(self, where, arg: fx.Node, module: nn.Module, name: str, out: FieldType) -> fx.Node:
        self._counter += 1
        target = f"equiconvert_{name}_{self._counter}"
        self.gm.add_submodule(target, module)
        with where:
            new = self.gm.graph.call_module(target, (arg,))
        new.meta[TYPE_KEY] = out
        self.report.layers.append(LayerChange(new.name, target, "(inserted)", _describe(module)))
        return new

    def insert_before(self, node: fx.Node, arg: fx.Node, module: nn.Module, name: str, out: FieldType) -> fx.Node:
        """Apply `module` to `arg` just before `node` and make `node` use the result."""
        new = self._insert(self.gm.graph.inserting_before(node), arg, module, name, out)
        node.replace_input_with(arg, new)
        return new

    def insert_after(self, node: fx.Node, module: nn.Module, name: str, out: FieldType) -> fx.Node:
        """Apply `module` to `node`'s output and make every other user of `node` use the result."""
        new = self._insert(self.gm.graph.inserting_after(node), node, module, name, out)
        new.meta[SHAPE_KEY] = node.meta.get(SHAPE_KEY)  # a change of basis keeps the shape
        node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
        return new

    def call_module_instead(self, node: fx.Node, module: nn.Module, name: str) -> None:
        """Turn a call_function/call_method node on one tensor into a call of `module`."""
        self._counter += 1
        target = f"equiconvert_{name}_{self._counter}"
        self.gm.add_submodule(target, module)
        before = getattr(node.target, "__name__", str(node.target))
        node.op, node.target, node.args, node.kwargs = "call_module", target, (node.args[0],), {}
        self.record(node, before, _describe(module))

    def set_spatial(self, node: fx.Node, op: SpatialOp) -> None:
        node.meta[SPATIAL_KEY] = op

    # --- diagnostics -------------------------------------------------------
    @classmethod
    def warning_at(cls, node: fx.Node, message: str) -> EquivarianceWarning:
        """An equivariance warning located at `node`: its name, module and line of model code."""
        return EquivarianceWarning(node.name, cls.module_path(node), cls.source_line(node), message)

    def warn(self, node: fx.Node, message: str) -> None:
        warning = self.warning_at(node, message)
        if self.config.strict:
            raise EquivarianceBreakError(f"{warning} (strict=True turns this warning into an error)")
        self.report.warnings.append(warning)

    def unsupported(self, node: fx.Node, message: str, options: str = "") -> UnsupportedLayerError:
        path = self.module_path(node)
        what = f"{type(self.module(node)).__name__}" if node.op == "call_module" else f"{node.op} {_target_name(node)}"
        src = self.source_line(node)
        text = (
            f"cannot convert node {node.name!r} ({what}"
            + (f", module {path!r}" if path else "")
            + (f", {src}" if src else "")
            + f"): {message}."
        )
        text += " " + (options or _DEFAULT_OPTIONS)
        return UnsupportedLayerError(text)


def _is_torch_internal(path: str) -> bool:
    return any(part in path for part in ("/torch/", "/equiconvert/convert/"))


_DEFAULT_OPTIONS = (
    "Options: replace it in the model before converting, or register a rule with "
    "equiconvert.register_module_rule / register_function_rule."
)


def _target_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target))


def _describe(module: nn.Module) -> str:
    extra = module.extra_repr()
    return f"{type(module).__name__}({extra})"
