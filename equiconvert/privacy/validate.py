"""Refuse models whose layers break DP-SGD's per-example privacy analysis.

DP-SGD bounds each example's influence by clipping its own gradient. A layer
that normalises with batch statistics mixes examples in the forward pass (so
per-example gradients are no longer per-example), and running statistics are
updated from private data without clipping or noise and then released with
the weights. Such layers are rejected whatever the module's train/eval mode,
since training switches them back to batch statistics.
"""

from __future__ import annotations

from torch import nn

from ..errors import PrivacyError

_TORCH_BATCH_NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.modules.batchnorm._BatchNorm,  # base of all of the above and of subclasses elsewhere
)
_TORCH_INSTANCE_NORMS: tuple[type[nn.Module], ...] = (
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d,
    nn.LazyInstanceNorm3d,
)
_FIX = (
    "convert the model with equiconvert.make_equivariant (it turns BatchNorm into a per-sample "
    "field GroupNorm), or replace the layer with nn.GroupNorm"
)


class PrivacyValidationError(PrivacyError):
    """The model contains layers that DP-SGD cannot train privately."""


def _running_stat_buffers(module: nn.Module) -> list[str]:
    """Names of the module's own running-statistics buffers (torch: running_mean; escnn: <field>_running_var)."""
    return [name for name, _ in module.named_buffers(recurse=False) if name.endswith(("running_mean", "running_var"))]


def _problem(module: nn.Module) -> str | None:
    """Why `module` is not DP-safe, or None if it is."""
    cls = type(module)
    if isinstance(module, _TORCH_BATCH_NORMS):
        return "batch norm mixes samples through batch statistics"
    if isinstance(module, _TORCH_INSTANCE_NORMS) and module.track_running_stats:
        return "track_running_stats=True accumulates statistics of private data without noise"
    if cls.__module__.startswith("escnn") and "BatchNorm" in cls.__name__:
        return "escnn batch norm mixes samples through batch statistics"
    buffers = _running_stat_buffers(module)
    if buffers:
        return f"running-statistics buffers {buffers} are updated from private data without noise"
    return None


def validate_dp_safe(model: nn.Module) -> None:
    """Raise PrivacyValidationError listing every layer DP-SGD cannot train privately.

    Only the outermost offending module is reported (replacing it removes its
    children, e.g. the BatchNorm3d inside escnn's InnerBatchNorm). Detects escnn
    classes by name and module path, so escnn is never imported here.
    """
    offenders: list[tuple[str, str]] = []  # (module path, message line)
    for path, module in model.named_modules():
        if any(_is_within(path, outer) for outer, _ in offenders):
            continue
        reason = _problem(module)
        if reason is not None:
            cls = type(module)
            offenders.append((path, f"{path or '<root>'} ({cls.__module__}.{cls.__qualname__}): {reason}"))
    if offenders:
        listing = "\n  ".join(line for _, line in offenders)
        raise PrivacyValidationError(
            f"{len(offenders)} module(s) are not safe for DP-SGD:\n  {listing}\nTo fix: {_FIX}."
        )


def _is_within(path: str, outer: str) -> bool:
    """Whether module `path` lies inside module `outer` ('' is the root model)."""
    return outer == "" or path.startswith(outer + ".")
