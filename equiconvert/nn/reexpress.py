"""Re-express a steerable model's checkpoint, saved with other bases or without fingerprints, in its canonical bases."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..errors import MissingFileError, NameMismatchError, UnreadableFileError
from ..untrusted_file import load_weights_only
from .conv import SteerableConv2d
from ..bases.canonical import orthonormal_span, reexpress_coefficients

_FINGERPRINT_SUFFIX = "._extra_state"
SPAN_TOLERANCE = 1e-4  # relative filter-space residual up to which two bases count as one span


def _layers(model: nn.Module) -> dict[str, SteerableConv2d]:
    return {name: module for name, module in model.named_modules() if isinstance(module, SteerableConv2d)}


def span_residual(basis: torch.Tensor, other: torch.Tensor) -> float:
    """Relative part of `basis`'s filters outside the span of `other` (0 when `other` spans them)."""
    flat = basis.reshape(basis.shape[0], -1).double()
    span = orthonormal_span(other)
    return float((flat - (flat @ span) @ span.T).norm() / flat.norm().clamp_min(1e-300))


def legacy_bases(model: nn.Module, directory: str | Path) -> dict[str, torch.Tensor]:
    """For each steerable layer, the basis in `directory` (an old basis cache, *.pt) spanning its filters.

    Among the cached bases with the layer's slice shape and size, the one whose span
    contains the layer's basis (residual below SPAN_TOLERANCE); an error names any
    layer without one.
    """
    candidates = []
    for path in sorted(Path(directory).glob("*.pt")):
        try:
            tensor = load_weights_only(path, map_location="cpu")
        except UnreadableFileError as error:
            raise UnreadableFileError(
                f"{path}: not readable as a basis file (read with weights_only=True); remove it from {directory} "
                "or give the directory of the old basis cache"
            ) from error.__cause__
        if isinstance(tensor, torch.Tensor) and tensor.ndim == 5:
            candidates.append((path.name, tensor))
    found: dict[str, torch.Tensor] = {}
    for name, layer in _layers(model).items():
        scored = [
            (span_residual(layer.basis, tensor), file, tensor)
            for file, tensor in candidates
            if tensor.shape == layer.basis.shape
        ]
        if not scored or min(s[0] for s in scored) > SPAN_TOLERANCE:
            raise MissingFileError(
                f"{name}: no basis of shape {tuple(layer.basis.shape)} spanning this layer's filters in {directory}; "
                "pass the layer's old basis to reexpress_state_dict explicitly"
            )
        found[name] = min(scored, key=lambda s: s[0])[2]
    return found


def reexpress_state_dict(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], old_bases: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A copy of `state_dict` whose steerable coefficients are re-expressed in `model`'s bases.

    old_bases maps layer names (as in model.named_modules()) to the bases the
    coefficients were trained with; each layer's filters are matched by least
    squares (exact when the spans agree) and its fingerprint is set to the
    model's. Other entries are copied unchanged.
    """
    layers = _layers(model)
    unknown = sorted(set(old_bases) - set(layers))
    if unknown:
        raise NameMismatchError(f"old_bases names no steerable layer of the model: {unknown}")
    result = dict(state_dict)
    for name, old in old_bases.items():
        layer = layers[name]
        key = f"{name}.weight"
        if key not in result:
            raise NameMismatchError(f"state_dict has no {key!r} for steerable layer {name}")
        result[key] = reexpress_coefficients(result[key], old, layer.basis)
        result[name + _FINGERPRINT_SUFFIX] = layer.get_extra_state()
    return result
