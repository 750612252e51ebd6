"""timm's SpaceToDepth -> FieldSpaceToDepth: block positions of trivial input fields become regular fields.

The rule finds, for each input channel, the orbits of the block's positions under the group's
grid elements, orders every orbit as the regular representation permutes its channels, and
checks the result on a test input before using it. Groups whose elements fix some positions
(reflections fix a block's diagonals) have no regular-field layout and are refused.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...groups import AnyGroupSpec
from ...nn.space_to_depth import FieldSpaceToDepth, space_to_depth
from ..context import ConversionContext
from ..fields import FieldType
from ..grid import WindowOp
from ..registry import LAZY_CHANNEL_FOLDS, register_module_rule


def regular_order(group: AnyGroupSpec, channels: int, block: int) -> list[int] | None:
    """Channel order of space_to_depth's output that makes it regular fields of `group`, or None if none does."""
    elements, size = group.grid_elements, block * block
    if len(elements) != group.order:
        return None
    index = torch.arange(size, dtype=torch.float64).view(1, 1, block, block)
    moved = [e.act_on_grid(index).flatten().long().tolist() for e in elements]  # moved[g][q]: source of q
    seen, orbits = set(), []
    for p in range(size):
        if p not in seen:
            orbit = [moved[g].index(p) for g in range(len(elements))]  # where element g moves position p
            if len(set(orbit)) != group.order:
                return None
            seen.update(orbit)
            orbits.append(orbit)
    # channel (row, column, c) of space_to_depth sits at (position * channels + c)
    for candidate in (orbits, [[o[0], *reversed(o[1:])] for o in orbits]):
        order = [pos * channels + c for c in range(channels) for orbit in candidate for pos in orbit]
        if _is_regular(group, order, channels, block):
            return order
    return None


def _is_regular(group: AnyGroupSpec, order: list[int], channels: int, block: int) -> bool:
    """Whether every grid element moves the reordered output as it moves regular fields (check.act_on_output)."""
    x = torch.randn(1, channels, 2 * block, 2 * block, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = space_to_depth(x, block)[:, order]
    fields = y.reshape(1, -1, group.order, 2, 2)
    for e in group.grid_elements:
        expected = e.act_on_grid(fields[:, :, torch.argsort(torch.tensor(e.regular_perm))].reshape(y.shape))
        if not torch.equal(space_to_depth(e.act_on_grid(x), block)[:, order], expected):
            return False
    return True


SPACE_TO_DEPTH = "timm.layers.space_to_depth:SpaceToDepth"
LAZY_CHANNEL_FOLDS[SPACE_TO_DEPTH] = lambda module: module.bs * module.bs


@register_module_rule(SPACE_TO_DEPTH)
def convert_space_to_depth(ctx: ConversionContext, node: fx.Node) -> FieldType:
    module, t = ctx.module(node), ctx.field_input(node)
    if not t.spatial or t.channels_last or not t.is_invariant:
        raise ctx.unsupported(node, f"space-to-depth on {t.describe()}; only trivial (input) fields have a rule")
    if getattr(t.group, "hidden_repr", None) != "regular":
        raise ctx.unsupported(node, f"space-to-depth has no field layout for {t.group.name}")
    order = regular_order(t.group, t.channels, module.bs)
    if order is None:
        raise ctx.unsupported(
            node,
            f"{t.group.name} fixes some positions of a {module.bs}x{module.bs} block, so "
            "space-to-depth's channels are no regular fields",
            "Options: convert for a rotation group (C2, C4), or replace the stem by a strided conv.",
        )
    ctx.replace_module(node, FieldSpaceToDepth(module.bs, order))
    ctx.set_spatial(node, WindowOp(module.bs, module.bs, 0))
    return FieldType(t.group, "regular", len(order) // t.group.order)
