"""Where a network restricts its fields to a subgroup, planned on the traced graph before rewriting.

`restrict=` accepts
  None                         no restriction;
  "halved" / "reflection" / "invariant" / a group name ("D4")
                               one restriction, before the last stage;
  a schedule "D8->D4->D1" or a list ["D4", "D1"]
                               one restriction per step, before the last stages, in order;
  a dict {"layer3": "halved"}  restrictions before the named modules.

A stage starts where the resolution drops for the last time: the restriction
sits on the input of the conv that leads to that downsampling (torchvision
ResNets: the stage's stride-2 conv; ResNet9: the conv before the stage's pool,
the paper's "before conv4"). Every use of that tensor sees the restricted fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import GroupSpecError, UnsupportedLayerError
from ..groups import AnyGroupSpec
from ..nn.restriction import FieldRestriction, ReflectionRestriction
from .context import SHAPE_KEY
from .fields import FieldType

# a step is "halved" / "reflection" / "invariant" / a group name; the forms are listed above
RestrictSpec = str | list[str] | tuple[str, ...] | dict[str, str] | None

_DOWNSAMPLING_MODULES = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)
_DOWNSAMPLING_FUNCTIONS = (F.max_pool2d, F.avg_pool2d, F.conv2d)


@dataclass(frozen=True)
class RestrictionPoint:
    node: str  # name of the tensor node whose users see the restricted fields
    target: Any  # "halved" / "reflection" / "invariant" / group name, relative to the group at that point


def parse_schedule(restrict: RestrictSpec, group_name: str) -> list | dict | None:
    """Normalise `restrict=` into None, a list of steps (last stages) or a {module: step} dict."""
    if restrict is None or isinstance(restrict, dict):
        return restrict or None
    if isinstance(restrict, str):
        steps = [s.strip() for s in restrict.split("->")]
        if len(steps) > 1:
            if steps[0].upper() != group_name.upper():
                raise GroupSpecError(
                    f"restriction schedule {restrict!r} must start with the model's group {group_name}"
                )
            steps = steps[1:]
        return steps
    if isinstance(restrict, (list, tuple)):
        return list(restrict)
    raise GroupSpecError(
        f"restrict={restrict!r}: use None, 'halved', 'reflection', 'invariant', a group name, "
        "a schedule like 'D8->D4->D1', or a {module name: step} dict"
    )


def _module_type(gm: fx.GraphModule, node: fx.Node):
    return type(gm.get_submodule(node.target)) if node.op == "call_module" else None


def _is_conv(gm: fx.GraphModule, node: fx.Node) -> bool:
    return _module_type(gm, node) is nn.Conv2d or (node.op == "call_function" and node.target is F.conv2d)


def _downsamples(gm: fx.GraphModule, node: fx.Node) -> bool:
    if not (
        (node.op == "call_module" and issubclass(_module_type(gm, node), _DOWNSAMPLING_MODULES))
        or (node.op == "call_function" and node.target in _DOWNSAMPLING_FUNCTIONS)
    ):
        return False
    shape, source = node.meta.get(SHAPE_KEY), node.args[0]
    before = source.meta.get(SHAPE_KEY) if isinstance(source, fx.Node) else None
    return bool(shape and before and len(shape) == 4 and len(before) == 4 and shape[-1] < before[-1])


def _conv_input(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """The input of the conv that leads to `node` through a chain of single-use ops (act, norm).

    The walk stops at a tensor with several users (a block input feeding a shortcut),
    so a shortcut pool (ResNet-D) is restricted on its own input, not a block earlier.
    """
    current = node
    while not _is_conv(gm, current):
        previous = current.args[0]
        if (
            not isinstance(previous, fx.Node)
            or previous.op == "placeholder"
            or len(previous.users) != 1
            or len(previous.all_input_nodes) != 1
        ):
            return previous
        current = previous
    return current.args[0]


def stage_inputs(gm: fx.GraphModule) -> list[fx.Node]:
    """One restriction point per resolution drop, in graph order.

    All ops that first reach a resolution (a bottleneck's stride-2 conv and its
    shortcut's pool or conv) must see restricted fields, so the point is the
    latest common ancestor of their conv inputs: the block input.
    """
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    drops: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if _downsamples(gm, node):
            drops.setdefault(node.meta[SHAPE_KEY][-1], []).append(node)
    points: list[fx.Node] = []
    for nodes in drops.values():
        common = set.intersection(*(_ancestors(_conv_input(gm, n)) for n in nodes))
        point = max(common, key=order.__getitem__)
        if point not in points:
            points.append(point)
    return points


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = {node}, [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def plan(gm: fx.GraphModule, restrict: RestrictSpec, group_name: str) -> list[RestrictionPoint]:
    """Restriction points of the traced, not yet rewritten graph."""
    schedule = parse_schedule(restrict, group_name)
    if schedule is None:
        return []
    if isinstance(schedule, dict):
        return [RestrictionPoint(_named_input(gm, name).name, step) for name, step in schedule.items()]
    stages = stage_inputs(gm)
    if len(schedule) > len(stages):
        raise UnsupportedLayerError(
            f"restriction schedule {restrict!r} has {len(schedule)} steps but the model has only {len(stages)} "
            "stages (resolution drops); pass a {module name: step} dict instead"
        )
    return [RestrictionPoint(node.name, step) for node, step in zip(stages[len(stages) - len(schedule) :], schedule)]


def _named_input(gm: fx.GraphModule, name: str) -> fx.Node:
    for node in gm.graph.nodes:
        path = str(node.target) if node.op == "call_module" else ""
        if path == name or path.startswith(name + "."):
            return node.args[0]
    raise UnsupportedLayerError(f"restrict names module {name!r}, which the traced model never calls")


def width_groups(gm: fx.GraphModule, points: list[RestrictionPoint], group: AnyGroupSpec) -> dict[int, AnyGroupSpec]:
    """Channel count -> group whose order sizes its fields: the group of the last conv of that width.

    So a stage whose end is restricted is sized for the subgroup throughout, as in
    the paper's released code (conv3 is already sized for D_{N/2} when "halved"
    restricts its output); layers added together keep equal field counts.
    """
    targets = {p.node: p.target for p in points}
    node_group: dict[fx.Node, AnyGroupSpec] = {}
    result: dict[int, AnyGroupSpec] = {}
    for node in gm.graph.nodes:
        inputs = [node_group[a] for a in node.all_input_nodes if a in node_group]
        current = min(inputs, key=lambda g: g.order) if inputs else group
        if _is_conv(gm, node) and node.op == "call_module":
            result[gm.get_submodule(node.target).out_channels] = current
        if node.name in targets:
            current = current.subgroup(targets[node.name])
        node_group[node] = current
    return result


# --- applying a restriction while rewriting ---------------------------------------------------


def _permutation(index: tuple[int, ...], split: int, representation: str):
    """A restriction that only reorders channels (nothing to insert when the order is kept)."""
    identity = tuple(index) == tuple(range(len(index)))
    return (lambda num_fields: None if identity else FieldRestriction(num_fields, tuple(index))), split, representation


def _restrict_irrep_field(group, sub):
    """SO(2)/O(2) fields: to the trivial group every channel is a plain channel; O(2) to D1 (the flip)
    by Hadamard pairs, each field becoming len(reflection_pairs) regular D1 fields."""
    if sub.order == 1:
        return _permutation(tuple(range(group.order)), group.order, "regular")
    pairs = group.reflection_pairs()
    return (lambda num_fields: ReflectionRestriction(num_fields, group.order, pairs)), len(pairs), "regular"


# representation -> (group, subgroup) -> (num_fields -> module or None, fields of the subgroup per field, representation)
FIELD_RESTRICTORS: dict[str, Any] = {
    "trivial": lambda group, sub: _permutation((0,), 1, "trivial"),  # trivial fields of any group: relabel only
    "regular": lambda group, sub: _permutation(group.restriction_index(sub), group.order // sub.order, "regular"),
    "field": _restrict_irrep_field,
}


def apply_restriction(ctx, node: fx.Node, step: Any):
    """Insert the change of basis after `node` and return the restricted field type."""
    t = ctx.type_of(node)
    if t is None:
        raise ctx.unsupported(node, f"restriction {step!r} is placed on a tensor that equiconvert could not type")
    try:
        sub = t.group.subgroup(step)
    except GroupSpecError as exc:
        raise ctx.unsupported(node, f"cannot restrict {t.group.name} fields: {exc}") from exc
    restrictor = FIELD_RESTRICTORS.get(t.representation)
    if restrictor is None:
        raise ctx.unsupported(node, f"no restriction is defined for {t.representation} fields")
    build, split, representation = restrictor(t.group, sub)
    out = FieldType(sub, representation, t.num_fields * split, t.spatial)
    module = build(t.num_fields)
    return ctx.insert_after(node, nn.Identity() if module is None else module, f"restrict_{sub.name}", out)
