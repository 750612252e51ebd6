"""Opacus per-sample gradients for equiconvert's steerable modules.

Importing this module registers, with Opacus' hook-based machinery
(``GradSampleModule``, ``PrivacyEngine.make_private``), a grad sampler for
``SteerableConv2d``, ``FieldGroupNorm`` and ``GroupStandardization`` (SO(2)/O(2)
fields) and, for ghost clipping, a norm sampler for each. It does nothing else:
no model is touched, nothing is printed, no Opacus behaviour other than these
two registries changes.

How the samplers work
---------------------
``SteerableConv2d``: the forward pass is ``F.conv2d(x, W(c), b(beta))`` with
the expanded filter ``W = coefficients x basis``. Opacus' hooks give the layer
input ``x`` and ``dL/dy`` per sample. The per-sample gradient of the expanded
filter is, as for ``nn.Conv2d``, the product of the backprops with the
unfolded (im2col) input, done per convolution group; inputs of layers with a
``padding_mode`` other than zeros are padded with ``F.pad`` first, exactly as
the layer's forward does. That filter gradient is contracted at once with the
basis -- the transpose of ``expand_filter`` -- to give the gradient of each
(output field, input field) coefficient vector. The batch is processed in
chunks so that the unfolded input and the full-size filter gradient only ever
exist for a few samples at a time. With ``weight_standardization`` the filter
is built from ``standardize(weight)``; the coefficient gradient is pulled back
through the layer's own ``coefficients()`` with ``torch.func.vjp`` (one vjp,
vmapped over the samples). The bias gradient is ``dL/dy`` summed over space
and over the channels of each output field (with ``bias_channels``, irrep fields: summed over space
only, on each listed trivial channel of each field).

``FieldGroupNorm``: ``y = x_hat * weight[field] + bias[field]``; the per-sample
gradients are ``x_hat * dL/dy`` and ``dL/dy`` summed over space and over the
channels of each field, with ``x_hat`` recomputed from the captured input the
way the layer's forward computes it (even and uneven field groups).

``GroupStandardization``: ``y = x_hat * weight[field]`` on every channel of a
field, ``+ bias[field]`` on its trivial channels only; the per-sample gradients
are ``x_hat * dL/dy`` summed over a field's channels and positions, and
``dL/dy`` summed over its trivial channels and positions, with ``x_hat`` from
the layer's own ``standardize``.

The norm samplers (used only with ``grad_sample_mode="ghost"``) compute the
same per-sample gradients chunk by chunk and keep only their norms. There is
no cheaper "ghost" identity for the basis-contracted convolution gradient.
"""
from __future__ import annotations

try:
    import opacus  # noqa: F401
except ModuleNotFoundError as _missing:  # only a missing Opacus becomes a friendly error; a broken one re-raises
    if _missing.name != "opacus":
        raise
    raise ImportError(
        "equiconvert.privacy.opacus_interop needs Opacus (pip install 'opacus>=1.5'); "
        "equiconvert's own DP trainer (equiconvert.privacy.trainer) does not."
    ) from _missing

from typing import Callable, Dict, List  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from opacus.grad_sample import register_grad_sampler  # noqa: E402
from torch import nn  # noqa: E402

from ..nn.conv import SteerableConv2d  # noqa: E402
from ..nn.irrep_fields import GroupStandardization  # noqa: E402
from ..nn.norm import FieldGroupNorm  # noqa: E402
from .filter_gradients import per_example_filter_gradients  # noqa: E402

try:  # Opacus >= 1.5 (ghost clipping)
    from opacus.grad_sample import register_norm_sampler  # noqa: E402
except ImportError:  # pragma: no cover - older Opacus: no norm samplers
    register_norm_sampler = None

__all__ = [
    "compute_steerable_conv_grad_sample",
    "compute_steerable_conv_norm_sample",
    "compute_field_group_norm_grad_sample",
    "compute_field_group_norm_norm_sample",
    "compute_group_standardization_grad_sample",
    "compute_group_standardization_norm_sample",
    "SUPPORTED_MODULES",
]

SUPPORTED_MODULES = (SteerableConv2d, FieldGroupNorm, GroupStandardization)

# Upper bound on the elements of the unfolded input plus the full-size filter
# gradient held at once (2**24 float32 = 64 MiB); at least one sample per chunk.
_CHUNK_ELEMENTS = 1 << 24
_NORM_CHUNK = 64  # samples per step of the norm samplers

GradSamples = Dict[nn.Parameter, torch.Tensor]


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


class _WithWeight:
    """The layer seen with `weight` replaced, so its own `coefficients()` can be differentiated."""

    def __init__(self, module: nn.Module, weight: torch.Tensor) -> None:
        self._module = module
        self.weight = weight

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _through_standardization(module: SteerableConv2d, coeff_grads: torch.Tensor) -> torch.Tensor:
    """Per-sample d(loss)/d(weight) from per-sample d(loss)/d(coefficients) (vjp of the standardization)."""
    coefficients = type(module).coefficients
    _, pullback = torch.func.vjp(lambda w: coefficients(_WithWeight(module, w)), module.weight.detach().to(coeff_grads.dtype))
    return torch.func.vmap(pullback)(coeff_grads)[0]


def _grouped_filter_gradients(module: SteerableConv2d, x: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """(m, G, out_channels/G, in_channels/G * k * k): per-sample filter gradients of a grouped conv, by unfolding."""
    padding = _pair(module.padding)
    if module.padding_mode != "zeros":  # the forward pads with F.pad, then convolves without padding
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]), mode=module.padding_mode)
        padding = (0, 0)
    m, positions, k = x.shape[0], backprops.shape[-2] * backprops.shape[-1], module.kernel_size
    cols = F.unfold(x, k, dilation=_pair(module.dilation), padding=padding, stride=_pair(module.stride))
    if cols.shape[-1] != positions:
        raise RuntimeError(f"SteerableConv2d grad sampler: unfolded {cols.shape[-1]} positions but the output has {positions}")
    cols = cols.reshape(m, module.groups, -1, positions)  # (m, G, in_per_group*in_size*k*k, L)
    grads = backprops.reshape(m, module.groups, -1, positions)  # (m, G, out_per_group*out_size, L)
    return grads @ cols.transpose(-1, -2)


def _conv_coefficient_grads(module: SteerableConv2d, x: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """(n, out_fields, in_fields/groups, num_basis): per-sample gradients w.r.t. `coefficients()`, the
    coefficient vectors the filter is expanded from (after weight standardization, when that is on)."""
    n = x.shape[0]
    groups, k = module.groups, module.kernel_size
    out_fields, in_per_group = module.out_fields, module.in_fields // module.groups
    out_size, in_size = module.out_size, module.in_size
    basis = module.basis.to(backprops.dtype).reshape(module.num_basis, -1)  # (nb, out_size*in_size*k*k)

    positions = backprops.shape[-2] * backprops.shape[-1]
    per_sample = module.in_channels * k * k * positions + module.out_channels * (module.in_channels // groups) * k * k
    chunk = max(1, _CHUNK_ELEMENTS // max(per_sample, 1))
    pieces = []
    for start in range(0, n, chunk):
        xs, gs = x[start:start + chunk], backprops[start:start + chunk]
        m = xs.shape[0]
        if groups == 1:  # the book-keeping kernel: no unfolded copy for stride-1 convs
            filter_grad = per_example_filter_gradients(
                xs, gs, 1, kernel=k, stride=module.stride, padding=module.padding, dilation=module.dilation,
                padding_mode=module.padding_mode).reshape(m, 1, module.out_channels, -1)
        else:
            filter_grad = _grouped_filter_gradients(module, xs, gs)
        # (m, G, out_fields/G, out_size, in_per_group, in_size*k*k) -> field pairs first: transpose of expand_filter
        filter_grad = filter_grad.reshape(m, groups, out_fields // groups, out_size, in_per_group, in_size * k * k)
        filter_grad = filter_grad.transpose(3, 4).reshape(m, out_fields, in_per_group, out_size * in_size * k * k)
        pieces.append(filter_grad @ basis.T)  # (m, out_fields, in_per_group, nb)
        del filter_grad
    return torch.cat(pieces) if pieces else backprops.new_zeros((0, out_fields, in_per_group, module.num_basis))


@register_grad_sampler(SteerableConv2d)
def compute_steerable_conv_grad_sample(
    layer: SteerableConv2d, activations: List[torch.Tensor], backprops: torch.Tensor
) -> GradSamples:
    """Opacus grad sampler: per-sample gradients of `weight` (coefficients) and `bias` (one per field)."""
    x = activations[0].to(backprops.dtype)
    ret: GradSamples = {}
    if layer.weight.requires_grad:
        grads = _conv_coefficient_grads(layer, x, backprops)
        if layer.weight_standardization and grads.shape[0] > 0:
            grads = _through_standardization(layer, grads)
        ret[layer.weight] = grads
    if layer.bias is not None and layer.bias.requires_grad:
        per_channel = backprops.unflatten(1, (layer.out_fields, layer.out_size)).flatten(3).sum(-1)  # (n, fields, size)
        channels = getattr(layer, "bias_channels", None)
        # one bias per field on all its channels, or (irrep fields) one per listed trivial channel of each field
        ret[layer.bias] = per_channel.sum(-1) if channels is None else per_channel[:, :, list(channels)]
    return ret


def _normalized(layer: FieldGroupNorm, x: torch.Tensor) -> torch.Tensor:
    """The layer's output before its affine map (same branches as its forward)."""
    if layer.num_fields % layer.num_groups == 0:
        return F.group_norm(x, layer.num_groups, None, None, layer.eps)
    return layer._normalize_uneven(x)


@register_grad_sampler(FieldGroupNorm)
def compute_field_group_norm_grad_sample(
    layer: FieldGroupNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> GradSamples:
    """Opacus grad sampler: per-sample gradients of the per-field scale and shift."""
    x = activations[0].to(backprops.dtype)
    per_field = backprops.unflatten(1, (layer.num_fields, layer.field_size)).flatten(2)
    ret: GradSamples = {}
    if layer.weight is not None and layer.weight.requires_grad:
        x_hat = _normalized(layer, x).unflatten(1, (layer.num_fields, layer.field_size)).flatten(2)
        ret[layer.weight] = (x_hat * per_field).sum(-1)
    if layer.bias is not None and layer.bias.requires_grad:
        ret[layer.bias] = per_field.sum(-1)
    return ret


@register_grad_sampler(GroupStandardization)
def compute_group_standardization_grad_sample(
    layer: GroupStandardization, activations: List[torch.Tensor], backprops: torch.Tensor
) -> GradSamples:
    """Opacus grad sampler: per-sample gradients of the per-field scale (all channels) and shift (trivial ones)."""
    x = activations[0].to(backprops.dtype)
    per_channel = backprops.unflatten(1, (layer.num_fields, layer.field_size)).unsqueeze(-1).flatten(3)  # (n, F, size, rest)
    ret: GradSamples = {}
    if layer.weight is not None and layer.weight.requires_grad:
        ret[layer.weight] = (layer.standardize(x) * per_channel).sum((2, 3))
    if layer.bias is not None and layer.bias.requires_grad:
        ret[layer.bias] = per_channel[:, :, : layer.trivial].sum((2, 3))
    return ret


def _norms_of(grad_sampler: Callable[..., GradSamples], layer: nn.Module, activations, backprops) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient norms, computed a few samples at a time so no (n, *param) tensor is kept."""
    n = backprops.shape[0]
    chunk = _NORM_CHUNK
    norms: Dict[nn.Parameter, list] = {}
    for start in range(0, max(n, 1), chunk):  # an empty batch still yields (0,) norms
        part = grad_sampler(layer, [a[start:start + chunk] for a in activations], backprops[start:start + chunk])
        for param, gs in part.items():
            norms.setdefault(param, []).append(gs.flatten(1).norm(2, dim=-1))
    return {param: torch.cat(values) for param, values in norms.items()}


def compute_steerable_conv_norm_sample(
    layer: SteerableConv2d, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Opacus norm sampler (ghost clipping): per-sample gradient norms of `weight` and `bias`."""
    return _norms_of(compute_steerable_conv_grad_sample, layer, activations, backprops)


def compute_field_group_norm_norm_sample(
    layer: FieldGroupNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Opacus norm sampler (ghost clipping): per-sample gradient norms of the per-field scale and shift."""
    return _norms_of(compute_field_group_norm_grad_sample, layer, activations, backprops)


def compute_group_standardization_norm_sample(
    layer: GroupStandardization, activations: List[torch.Tensor], backprops: torch.Tensor
) -> Dict[nn.Parameter, torch.Tensor]:
    """Opacus norm sampler (ghost clipping): per-sample gradient norms of the per-field scale and shift."""
    return _norms_of(compute_group_standardization_grad_sample, layer, activations, backprops)


if register_norm_sampler is not None:
    register_norm_sampler(SteerableConv2d)(compute_steerable_conv_norm_sample)
    register_norm_sampler(FieldGroupNorm)(compute_field_group_norm_norm_sample)
    register_norm_sampler(GroupStandardization)(compute_group_standardization_norm_sample)
