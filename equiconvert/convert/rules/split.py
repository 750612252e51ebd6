"""Channel splits (split, chunk, channel slices) and the widths that keep their pieces whole fields.

A split of a C-channel map into pieces of p_1..p_k channels is equivariant when every
piece is a run of whole fields. consistent_width makes that so: a channel count that a
split (or the concatenation in the same module, CSPNet/Res2Net/MixNet style) divides into
pieces gets the sum of its pieces' field counts, so the pieces, the layers that consume
them and the residual sums beside them agree on their field counts.
"""

from __future__ import annotations

import math
import operator
from typing import Callable

import torch
import torch.fx as fx

from ...groups import AnyGroupSpec
from ..context import SHAPE_KEY, ConversionContext
from ..fields import FieldSum, FieldType, Segment, join, segments_of
from ..registry import register_function_rule, takes_direct_sums

PIECES_KEY = "equiconvert_pieces"
SPLITS = (torch.split, torch.chunk, "split", "chunk")
CATS = (torch.cat, torch.concat)
NARROWS = (torch.narrow, "narrow")
SUMS = (operator.add, operator.iadd, operator.sub, torch.add, "add", "add_")


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _channels_in(node: fx.Node) -> int | None:
    x = node.args[0]
    shape = x.meta.get(SHAPE_KEY) if isinstance(x, fx.Node) else None
    return shape[1] if shape and len(shape) == 4 else None


def split_pieces(node: fx.Node) -> tuple[int, ...] | None:
    """Channel sizes of the pieces of a split/chunk node along dim 1, else None."""
    channels = _channels_in(node)
    if channels is None or _arg(node, 2, "dim", 0) not in (1, -3):
        return None
    if node.target in (torch.chunk, "chunk"):
        n = _arg(node, 1, "chunks")
        size = -(-channels // n)
        return tuple(min(size, channels - i * size) for i in range(n) if channels - i * size > 0)
    size = _arg(node, 1, "split_size_or_sections", _arg(node, 1, "split_size"))
    if isinstance(size, int):
        return tuple(min(size, channels - i) for i in range(0, channels, size))
    if isinstance(size, (tuple, list)) and all(isinstance(p, int) for p in size):
        return tuple(size)
    return None  # sizes computed at run time


def _module_of(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack)[-1]) if stack else ""


def _offsets(pieces: tuple[int, ...]) -> list[int]:
    return [sum(pieces[:i]) for i in range(len(pieces) + 1)]


def _closed_partitions(segmentations: dict[int, set[tuple[int, ...]]]) -> dict[int, tuple[int, ...]]:
    """Channel count -> its finest pieces, closed so that every piece count is cut like the pieces it lies in.

    A count C cut into pieces (p_1, .., p_k) in one place and differently in another gets the cuts of
    both; a piece p_i of C then carries C's cuts inside it, and C carries p_i's own cuts at p_i's offset.
    Field counts summed over the finest pieces then add up: fields(C) = sum of fields(p_i) for every
    segmentation of C, and two maps of C channels built either way agree field by field.
    """
    cuts: dict[int, set[int]] = {c: set() for c in segmentations}
    for c, segs in segmentations.items():
        for pieces in segs:
            cuts[c] |= set(_offsets(pieces)[1:-1])
    changed = True
    while changed:
        changed = False
        for c, segs in segmentations.items():
            for pieces in segs:
                for start, size in zip(_offsets(pieces), pieces):
                    inner = {x - start for x in cuts[c] if start < x < start + size}
                    own = cuts.get(size, set())
                    if not inner <= own:
                        cuts[size] = own | inner
                        changed = True
                    outer = {start + x for x in cuts.get(size, ())}
                    if not outer <= cuts[c]:
                        cuts[c] |= outer
                        changed = True
    partitions = {}
    for c, cut in cuts.items():
        if cut:
            bounds = [0, *sorted(cut), c]
            partitions[c] = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    return partitions


def channel_partitions(gm: fx.GraphModule) -> dict[int, tuple[int, ...]]:
    """Channel count -> the finest pieces that its splits (or concatenations beside them, or slices) cut it into."""
    segmentations: dict[int, set[tuple[int, ...]]] = {}
    split_modules = set()
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and node.target in SPLITS:
            pieces = split_pieces(node)
            if pieces and len(pieces) > 1:
                segmentations.setdefault(sum(pieces), set()).add(pieces)
                split_modules.add(_module_of(node))
    for node in gm.graph.nodes:  # x[:, a:b] on a map: its channels split at a and b (ReXNet, DPN)
        cut = _channel_slice(node)
        if cut is not None:
            channels, start, stop = cut
            pieces = tuple(p for p in (start, stop - start, channels - stop) if p > 0)
            if len(pieces) > 1:
                segmentations.setdefault(channels, set()).add(pieces)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in CATS and _arg(node, 1, "dim", 0) in (1, -3):
            shapes = [a.meta.get(SHAPE_KEY) for a in node.args[0] if isinstance(a, fx.Node)]
            sliced = any(u.target is operator.getitem or u.target in NARROWS for u in node.users)
            if all(s and len(s) == 4 for s in shapes) and (
                _module_of(node) in split_modules or sliced or _reaches_a_sum(node)
            ):
                segmentations.setdefault(sum(s[1] for s in shapes), set()).add(tuple(s[1] for s in shapes))
    return _closed_partitions(segmentations)


def _reaches_a_sum(node: fx.Node) -> bool:
    """True if the map of `node` meets another map in a sum (a residual on a concatenation), through ops that keep
    its channels (norms, activations, pooling), so that both sides of the sum get the fields of its parts."""
    channels = node.meta.get(SHAPE_KEY)[1]
    for user in node.users:
        if user.target in SUMS:
            return True
        shape = user.meta.get(SHAPE_KEY)
        keeps = shape and len(shape) == 4 and shape[1] == channels and len(user.all_input_nodes) == 1
        if keeps and not _is_layer_with_weights(user) and _reaches_a_sum(user):
            return True
    return False


def _is_layer_with_weights(node: fx.Node) -> bool:
    """A conv or linear layer: its output is a new map, whatever its channel count."""
    if node.op != "call_module":
        return False
    module = node.graph.owning_module.get_submodule(str(node.target))
    return isinstance(module, (torch.nn.Conv2d, torch.nn.ConvTranspose2d, torch.nn.Linear))


def _channel_slice(node: fx.Node) -> tuple[int, int, int] | None:
    """(channels, start, stop) of a getitem x[:, start:stop] or a narrow x.narrow(1, start, length) on a 4D map,
    else None."""
    if node.target in NARROWS and isinstance(node.args[0], fx.Node):
        shape = node.args[0].meta.get(SHAPE_KEY)
        dim, start, length = (_arg(node, i, name) for i, name in ((1, "dim"), (2, "start"), (3, "length")))
        if not shape or len(shape) != 4 or dim not in (1, -3) or not isinstance(start, int):
            return None
        start = start % shape[1]
        return (shape[1], start, start + length) if isinstance(length, int) else None
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return None
    shape, index = node.args[0].meta.get(SHAPE_KEY), node.args[1]
    if not shape or len(shape) != 4 or not isinstance(index, tuple) or len(index) < 2 or index[0] != slice(None):
        return None
    if not isinstance(index[1], slice) or index[1].step not in (None, 1) or any(i != slice(None) for i in index[2:]):
        return None
    start, stop, _ = index[1].indices(shape[1])
    return shape[1], start, stop


def _piece_multiples(partitions: dict[int, tuple[int, ...]], multiples: dict[int, int]) -> dict[int, int]:
    """Multiples for the field counts of unpartitioned counts, so that grouped convs on partitioned ones divide.

    A partitioned count C whose grouped convs need a multiple m of fields, cut into k equal pieces of q
    channels, gets it when fields(q) is a multiple of m / gcd(m, k) (DPN's grouped 3x3 beside its slices).
    """
    found = {c: m for c, m in multiples.items() if c not in partitions}
    for channels, pieces in partitions.items():
        m = multiples.get(channels, 1)
        if m > 1 and len(set(pieces)) == 1 and pieces[0] not in partitions:
            found[pieces[0]] = math.lcm(found.get(pieces[0], 1), m // math.gcd(m, len(pieces)))
    return found


def consistent_width(gm: fx.GraphModule, width_fn: Callable, multiples: dict[int, int] | None = None) -> Callable:
    """width_fn, except that a partitioned channel count gets the sum of its pieces' field counts.

    multiples: channel count -> multiple its field count must be (grouped convs); pieces are rounded so
    that partitioned counts meet theirs.
    """
    partitions = channel_partitions(gm)
    if not partitions:
        return width_fn
    piece_multiples = _piece_multiples(partitions, multiples or {})

    def fields(channels: int, group: AnyGroupSpec) -> int:
        pieces = partitions.get(channels)
        if pieces:
            return sum(fields(p, group) for p in pieces)
        m = piece_multiples.get(channels, 1)
        return max(m, round(width_fn(channels, group) / m) * m)

    fields.__name__ = getattr(width_fn, "__name__", "width")
    fields.partitions = partitions  # read by the split rules to place field boundaries
    return fields


def _field_boundary(ctx: ConversionContext, t: FieldType, channels: int, cut: int) -> int | None:
    """The field index where channel `cut` of a `channels`-channel map of type `t` falls, if on a field boundary."""
    refined = getattr(ctx.width_fn, "partitions", {}).get(channels)
    if refined:
        fields = [ctx.fields_for(p, t.group) for p in refined]
        bounds = [sum(refined[:i]) for i in range(len(refined) + 1)]
        if sum(fields) == t.num_fields and cut in bounds:
            return sum(fields[: bounds.index(cut)])
    return t.num_fields * cut // channels if t.num_fields * cut % channels == 0 else None


def converted_cut(ctx: ConversionContext, t: FieldType | FieldSum, channels: int, cut: int) -> int | None:
    """The channel of the converted map where channel `cut` of the original `channels` falls, if that is a field
    boundary: found in the concatenated part (fields.Segment) that holds it."""
    start, converted = 0, 0
    for segment in segments_of(t, channels):
        if cut <= start + segment.channels:
            boundary = _segment_boundary(ctx, segment, cut - start)
            return None if boundary is None else converted + boundary * segment.ftype.field_size
        start, converted = start + segment.channels, converted + segment.ftype.channels
    return None


def _segment_boundary(ctx: ConversionContext, segment: Segment, cut: int) -> int | None:
    """The field index of channel `cut` of a concatenated map, counted on the whole map a slice kept it from."""
    whole = segment.origin or segment
    first = _field_boundary(ctx, whole.ftype, whole.channels, segment.start)
    last = _field_boundary(ctx, whole.ftype, whole.channels, segment.start + cut)
    return None if first is None or last is None else last - first


def selected_type(t: FieldType | FieldSum, channels: int, bounds: tuple[int, int], converted: tuple[int, int]):
    """The type of channels bounds[0]:bounds[1] of the original, which are converted[0]:converted[1] converted:
    the concatenated parts they cover, cut where a part is cut."""
    chosen, start, offset = [], 0, 0
    for segment in segments_of(t, channels):
        low, high = max(bounds[0], start), min(bounds[1], start + segment.channels)
        if low < high:
            first, last = max(converted[0], offset), min(converted[1], offset + segment.ftype.channels)
            kept = segment.ftype.with_fields((last - first) // segment.ftype.field_size)
            whole = high - low == segment.channels
            origin = segment.origin or (None if whole else segment)
            chosen.append(Segment(high - low, kept, origin, segment.start + low - start))
        start, offset = start + segment.channels, offset + segment.ftype.channels
    return join(tuple(chosen), t.spatial)


def _converted_bounds(ctx: ConversionContext, node: fx.Node, t, channels: int, pieces: tuple[int, ...]) -> list[int]:
    """The converted channel where each piece of a split starts (and the last ends), else a clear refusal."""
    bounds = [converted_cut(ctx, t, channels, cut) for cut in _offsets(pieces)]
    if None not in bounds:
        return bounds
    raise ctx.unsupported(
        node,
        f"splits {channels} channels into {pieces}, which cuts through the fields of {t.describe()}",
        "Options: pass width= as a callable whose field counts split the same way, or split into equal halves/chunks.",
    )


@register_function_rule(*SPLITS)
@takes_direct_sums
def convert_split(ctx: ConversionContext, node: fx.Node) -> FieldType | FieldSum:
    """The node's type stays its input's (a tuple of views of one map); getitem reads the pieces' types."""
    t = ctx.field_input(node)
    pieces = split_pieces(node)
    if pieces is None or not t.spatial or t.channels_last:
        raise ctx.unsupported(
            node,
            "splits a feature tensor along a dim other than the channels, or by sizes computed at run time",
            "Options: split dim 1 by constant sizes.",
        )
    channels = sum(pieces)
    bounds = _converted_bounds(ctx, node, t, channels, pieces)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    if node.target in (torch.chunk, "chunk") and len(set(sizes)) != 1:  # equal pieces of unequal fields
        node.target = torch.split if node.op == "call_function" else "split"
        ctx.record(node, f"chunk into {len(pieces)}", f"split into {sizes} channels")
    if node.target in (torch.split, "split"):
        node.args, node.kwargs = (node.args[0], sizes, 1), {}
    offsets = _offsets(pieces)
    node.meta[PIECES_KEY] = [
        selected_type(t, channels, (offsets[i], offsets[i + 1]), (bounds[i], bounds[i + 1])) for i in range(len(pieces))
    ]
    return t


def convert_channel_getitem(ctx: ConversionContext, node: fx.Node) -> FieldType | FieldSum | None:
    """A piece of a split, or x[:, a:b] over whole fields (GhostNet trims its concatenation, a dense net keeps its
    newest block); None if neither."""
    source, index = node.args
    pieces = source.meta.get(PIECES_KEY) if isinstance(source, fx.Node) else None
    if pieces is not None and isinstance(index, int):
        return pieces[index]
    t = ctx.type_of(source)
    if t is None or not isinstance(index, tuple) or len(index) < 2 or index[0] != slice(None):
        return None
    if any(i != slice(None) for i in index[2:]) or not t.spatial or t.channels_last:
        return None
    channels, cut = ctx.shape(source)[1], index[1]
    if not isinstance(cut, slice) or cut.step not in (None, 1):
        return None
    start, stop, _ = cut.indices(channels)
    new_index, ftype = _channel_range(ctx, node, t, channels, start, stop)
    node.args = (source, (index[0], slice(*new_index), *index[2:]))
    ctx.record(
        node, f"channels {start}:{stop} of {channels}", f"channels {new_index[0]}:{new_index[1]} ({ftype.describe()})"
    )
    return ftype


def _channel_range(ctx: ConversionContext, node: fx.Node, t, channels: int, start: int, stop: int):
    """((start, stop) in the converted map, type) of channels start:stop of the original, else a clear refusal."""
    first, last = converted_cut(ctx, t, channels, start), converted_cut(ctx, t, channels, stop)
    if first is None or last is None:
        raise ctx.unsupported(
            node,
            f"keeps channels {start}:{stop} of {channels}, which cuts through the fields of {t.describe()}",
            "Options: select whole concatenated maps, or pass width= as a callable whose field counts the slice "
            "divides.",
        )
    return (first, last), selected_type(t, channels, (start, stop), (first, last))


@register_function_rule(torch.narrow, "narrow")
@takes_direct_sums
def convert_narrow(ctx: ConversionContext, node: fx.Node) -> FieldType | FieldSum:
    """x.narrow(1, start, length): the converted channels of the fields it selects."""
    t = ctx.field_input(node)
    dim, start, length = (_arg(node, i, name) for i, name in ((1, "dim"), (2, "start"), (3, "length")))
    if dim not in (1, -3) or not t.spatial or t.channels_last or not all(isinstance(v, int) for v in (start, length)):
        raise ctx.unsupported(
            node, "narrows a feature tensor along a dim other than the channels, or by a length computed at run time"
        )
    channels = ctx.shape(node.args[0])[1]
    start = start % channels if start < 0 else start
    (first, last), ftype = _channel_range(ctx, node, t, channels, start, start + length)
    node.args, node.kwargs = (node.args[0], dim, first, last - first), {}
    ctx.record(
        node, f"channels {start}:{start + length} of {channels}", f"channels {first}:{last} ({ftype.describe()})"
    )
    return ftype
