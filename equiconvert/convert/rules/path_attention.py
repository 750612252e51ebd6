"""timm's selective kernel (SKNet) and split attention (ResNeSt) -> FieldPathAttention.

Both stack or reshape their paths into a 5D tensor that the field types cannot describe. Their
traceable forms trace the paths' convolutions as usual and end in one `attend_paths` node
holding the attention module; its rule replaces that node by FieldPathAttention on the paths.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch import nn

from ...nn.path_attention import FieldPathAttention
from ..context import ConversionContext
from ..fields import FieldType
from ..registry import register_function_rule, register_traceable_form


def attend_paths(module: nn.Module, *paths: torch.Tensor) -> torch.Tensor:
    """The original attention of `module` (a SelectiveKernel or SplitAttn) over its paths' outputs."""
    if hasattr(module, "attn"):  # SelectiveKernel
        x = torch.stack(paths, dim=1)
        return torch.sum(x * module.attn(x), dim=1)
    (x,) = paths
    batch, channels, height, width = x.shape
    if module.radix > 1:
        x = x.reshape((batch, module.radix, channels // module.radix, height, width))
        gap = x.sum(dim=1)
    else:
        gap = x
    gap = module.act1(module.bn1(module.fc1(gap.mean((2, 3), keepdim=True))))
    attn = module.rsoftmax(module.fc2(gap)).view(batch, -1, 1, 1)
    if module.radix > 1:
        return (x * attn.reshape((batch, module.radix, channels // module.radix, 1, 1))).sum(dim=1).contiguous()
    return (x * attn).contiguous()


torch.fx.wrap("attend_paths")


@register_traceable_form("timm.layers.selective_kernel:SelectiveKernel")
def selective_kernel_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if module.split_input:
        pieces = torch.split(x, module.in_channels // module.num_paths, 1)
        return attend_paths(module, *[op(pieces[i]) for i, op in enumerate(module.paths)])
    return attend_paths(module, *[op(x) for op in module.paths])


@register_traceable_form("timm.layers.split_attn:SplitAttn")
def split_attention_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return attend_paths(module, module.act0(module.drop(module.bn0(module.conv(x)))))


@register_function_rule(attend_paths)
def convert_attend_paths(ctx: ConversionContext, node: fx.Node) -> FieldType:
    holder, *paths = node.args
    module = ctx.gm.get_submodule(holder.target)
    types = [ctx.field_input(node, i + 1) for i in range(len(paths))]
    t = types[0]
    if any(u != t for u in types) or not t.spatial or t.channels_last or t.representation not in ("regular", "trivial"):
        raise ctx.unsupported(
            node,
            f"attends over paths of field types {[u.describe() for u in types]}; "
            "it needs equal channels-first maps of regular fields",
        )
    if hasattr(module, "attn"):
        count, fc1, norm, act = len(paths), module.attn.fc_reduce, module.attn.bn, module.attn.act
    else:
        count, fc1, norm, act = module.radix, module.fc1, module.bn1, module.act1
    if t.num_fields % count:
        raise ctx.unsupported(
            node,
            f"splits {t.num_fields} fields into {count} equal paths",
            "Options: pass width= as a callable returning multiples of the radix.",
        )
    fields = t.num_fields // count if len(paths) == 1 else t.num_fields
    new = FieldPathAttention(
        count, fields, t.field_size, fc1.out_channels, copy.deepcopy(act), norm=not isinstance(norm, nn.Identity)
    )
    ctx.call_module_instead(node, new, "path_attention")
    node.args = tuple(paths)
    ctx.gm.graph.erase_node(holder)
    for name in ("attn",) if hasattr(module, "attn") else ("fc1", "bn1", "act1", "fc2", "rsoftmax"):
        delattr(module, name)  # replaced by FieldPathAttention; the paths' own layers stay in the graph
    return t.with_fields(fields)
