"""Direct sums of field types between the rules: kept for rules that read them, lifted for the others.

A concatenation of maps of different representations (fields.FieldSum) reaches rules marked with
registry.takes_direct_sums as it is. Before any other rule, each such input is lifted to regular fields
(nn/direct_sum.FieldLift, one per lifted map, reused by its later readers), so every layer converts exactly.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx as fx

from ..nn.direct_sum import FieldLift, lift_index
from .context import SHAPE_KEY, ConversionContext
from .fields import FieldSum, FieldType
from .registry import SUM_RULES, Rule

LIFTED_KEY = "equiconvert_lifted"  # on a node of direct-sum type: its lifted form, once inserted


def run_rule(ctx: ConversionContext, node: fx.Node, rule: Rule) -> "FieldType | FieldSum | None":
    """rule(ctx, node), its direct-sum inputs lifted first unless the rule reads them."""
    if rule not in SUM_RULES:
        lift_direct_sums(ctx, node)
    return rule(ctx, node)


def lifted_output(ctx: ConversionContext, node: fx.Node) -> fx.Node:
    """`node` itself, or, where it is a direct sum, its output lifted to regular fields for every later reader (a
    restriction placed on a concatenation with the image restricts the lifted fields)."""
    ftype = ctx.type_of(node)
    if not isinstance(ftype, FieldSum):
        return node
    out, index = _lift_plan(ctx, node, ftype)
    return ctx.insert_after(node, FieldLift(index), "lift", out)


def lift_direct_sums(ctx: ConversionContext, node: fx.Node) -> None:
    """Make `node` read each of its direct-sum inputs as regular fields."""
    for arg in node.all_input_nodes:
        ftype = ctx.type_of(arg)
        if isinstance(ftype, FieldSum):
            node.replace_input_with(arg, _lifted(ctx, node, arg, ftype))


def _lift_plan(ctx: ConversionContext, node: fx.Node, ftype: FieldSum) -> tuple[FieldType, torch.Tensor]:
    """The regular field type a direct sum lifts to, and FieldLift's channel index."""
    group = ftype.group
    if group.hidden_repr != "regular":
        raise ctx.unsupported(
            node, f"reads a direct sum of {group.name} fields, which has no regular fields to lift to"
        )
    size = group.repr_size("regular")
    # a trivial field becomes one regular field: field counts, and so the places of later cuts, stay as they were
    lifted_segments = tuple(replace(s, ftype=FieldType(group, "regular", s.ftype.num_fields)) for s in ftype.segments)
    out = FieldType(group, "regular", ftype.num_fields, ftype.spatial, segments=lifted_segments)
    return out, lift_index([(s.ftype.num_fields, s.ftype.field_size) for s in ftype.segments], size)


def _lifted(ctx: ConversionContext, node: fx.Node, arg: fx.Node, ftype: FieldSum) -> fx.Node:
    if LIFTED_KEY in arg.meta:
        return arg.meta[LIFTED_KEY]
    out, index = _lift_plan(ctx, node, ftype)
    lifted = ctx.insert_before(node, arg, FieldLift(index), "lift", out)
    lifted.meta[SHAPE_KEY] = arg.meta.get(SHAPE_KEY)
    arg.meta[LIFTED_KEY] = lifted
    return lifted
