"""Opacus per-sample gradients for equiconvert's steerable modules.

Before handing a model to Opacus, check it with ``check_dp_safe``: Opacus'
validator misses layers such as timm's ``BatchNormAct2d`` (a BatchNorm subclass
whose batch statistics couple the examples). ``make_private`` here does that and
then calls ``PrivacyEngine.make_private``.

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
filter comes from ``filter_gradients.per_example_filter_gradients``, the kernels
book-keeping uses (the method in force: on CUDA the fastest per layer shape; other
``padding_mode`` values padded with ``F.pad`` first, as the layer's forward does).
``filter_gradients.steerable_weight_gradients`` then takes it to the gradient of
``weight``: the basis contraction (the transpose of ``expand_filter``) and, with
``weight_standardization``, the vjp of the layer's own ``coefficients()``
vmapped over the samples. The batch is processed in chunks so that the
full-size filter gradient only ever exists for a few samples at a time.
The bias gradient is ``dL/dy`` summed over space
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

import warnings

try:
    import opacus  # noqa: F401
except ModuleNotFoundError as _missing:  # only a missing Opacus becomes a friendly error; a broken one re-raises
    if _missing.name != "opacus":
        raise
    raise ImportError(
        "equiconvert.privacy.opacus_interop needs Opacus (pip install 'opacus>=1.5'); "
        "equiconvert's own DP trainer (equiconvert.training.trainer) does not."
    ) from _missing

from typing import Any, Callable, Dict, List  # noqa: E402

import torch  # noqa: E402
from opacus.grad_sample import register_grad_sampler  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import vjp, vmap  # noqa: E402

from ..nn.conv import SteerableConv2d  # noqa: E402
from ..nn.irrep_fields import GroupStandardization  # noqa: E402
from ..nn.norm import FieldGroupNorm  # noqa: E402
from .buffer_guard import BufferGuard  # noqa: E402
from .dp_safety import check_dp_safe  # noqa: E402
from .filter_gradients import per_example_filter_gradients, steerable_weight_gradients  # noqa: E402
from .optimizer_params import check_optimizer_params  # noqa: E402

try:  # Opacus >= 1.5 (ghost clipping)
    from opacus.grad_sample import register_norm_sampler  # noqa: E402
except ImportError:  # pragma: no cover - older Opacus: no norm samplers
    register_norm_sampler = None

__all__ = [
    "make_private",
    "contiguous_conv_inputs",
    "compute_steerable_conv_grad_sample",
    "compute_steerable_conv_norm_sample",
    "compute_field_group_norm_grad_sample",
    "compute_field_group_norm_norm_sample",
    "compute_group_standardization_grad_sample",
    "compute_group_standardization_norm_sample",
    "SUPPORTED_MODULES",
]

SUPPORTED_MODULES = (SteerableConv2d, FieldGroupNorm, GroupStandardization)

# Upper bound on the elements of the input patches plus the full-size filter
# gradient held at once (2**24 float32 = 64 MiB); at least one sample per chunk.
_CHUNK_ELEMENTS = 1 << 24
_NORM_CHUNK = 64  # samples per step of the norm samplers

GradSamples = Dict[nn.Parameter, torch.Tensor]


def _weight_grads(module: SteerableConv2d, x: torch.Tensor, backprops: torch.Tensor) -> torch.Tensor:
    """(n, out_fields, in_fields/groups, num_basis): per-sample gradients of `weight`, in chunks of samples."""
    k, n = module.kernel_size, x.shape[0]
    positions = backprops.shape[-2] * backprops.shape[-1]
    per_sample = (
        module.in_channels * k * k * positions + module.out_channels * (module.in_channels // module.groups) * k * k
    )
    chunk = max(1, _CHUNK_ELEMENTS // max(per_sample, 1))
    pieces = [
        steerable_weight_gradients(
            module,
            per_example_filter_gradients(
                x[start : start + chunk],
                backprops[start : start + chunk],
                1,
                kernel=k,
                stride=module.stride,
                padding=module.padding,
                dilation=module.dilation,
                padding_mode=module.padding_mode,
                groups=module.groups,
            ),
        )
        for start in range(0, n, chunk)
    ]
    return torch.cat(pieces) if pieces else backprops.new_zeros((0, *module.weight.shape))


@register_grad_sampler(SteerableConv2d)
def compute_steerable_conv_grad_sample(
    layer: SteerableConv2d, activations: List[torch.Tensor], backprops: torch.Tensor
) -> GradSamples:
    """Opacus grad sampler: per-sample gradients of `weight` (coefficients) and `bias` (one per field)."""
    x = activations[0].to(backprops.dtype)
    ret: GradSamples = {}
    if layer.weight.requires_grad:
        ret[layer.weight] = _weight_grads(layer, x, backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        # the VJP of expand_bias (as book-keeping takes it): whatever maps the bias to its channels maps back here
        _, bias_vjp = vjp(layer.expand_bias, layer.bias.detach().to(backprops.dtype))
        channel_sums = backprops.flatten(2).sum(-1)  # (n, channels)
        ret[layer.bias] = vmap(lambda g: bias_vjp(g)[0])(channel_sums)
    return ret


@register_grad_sampler(FieldGroupNorm)
def compute_field_group_norm_grad_sample(
    layer: FieldGroupNorm, activations: List[torch.Tensor], backprops: torch.Tensor
) -> GradSamples:
    """Opacus grad sampler: per-sample gradients of the per-field scale and shift."""
    x = activations[0].to(backprops.dtype)
    per_field = backprops.unflatten(1, (layer.num_fields, layer.field_size)).flatten(2)
    ret: GradSamples = {}
    if layer.weight is not None and layer.weight.requires_grad:
        x_hat = layer._standardize(x).unflatten(1, (layer.num_fields, layer.field_size)).flatten(2)
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
    per_channel = (
        backprops.unflatten(1, (layer.num_fields, layer.field_size)).unsqueeze(-1).flatten(3)
    )  # (n, F, size, rest)
    ret: GradSamples = {}
    if layer.weight is not None and layer.weight.requires_grad:
        ret[layer.weight] = (layer.standardize(x) * per_channel).sum((2, 3))
    if layer.bias is not None and layer.bias.requires_grad:
        ret[layer.bias] = per_channel[:, :, : layer.trivial].sum((2, 3))
    return ret


def _norms_of(
    grad_sampler: Callable[..., GradSamples], layer: nn.Module, activations, backprops
) -> Dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradient norms, computed a few samples at a time so no (n, *param) tensor is kept."""
    n = backprops.shape[0]
    chunk = _NORM_CHUNK
    norms: Dict[nn.Parameter, list] = {}
    for start in range(0, max(n, 1), chunk):  # an empty batch still yields (0,) norms
        part = grad_sampler(layer, [a[start : start + chunk] for a in activations], backprops[start : start + chunk])
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


OPACUS_NOT_SECURE = (
    "opacus_interop.make_private: PrivacyEngine(secure_mode=False) (Opacus' default) draws the noise and the "
    "Poisson sampling from torch's generators: whoever knows or guesses their seed (torch.manual_seed) can "
    "recompute the noise, and the run is not private. Pass PrivacyEngine(secure_mode=True) (needs torchcsprng), or "
    "use equiconvert.privacy.PrivacyEngine, whose randomness is secret unless debug_seed is given"
)


# Opacus' own Conv2d samplers (dense and ghost) pad their input and read its patches through `as_strided` with
# the strides of a contiguous tensor. On the CPU the padded copy of a channels-last input keeps its layout, so they
# read the wrong elements: silently wrong per-sample gradients (tests/privacy/test_opacus_interop.py), so norms that
# bound nothing. (On CUDA the padded copy is contiguous; there the guard costs one copy of each input.)
_OPACUS_STRIDED_CONVS = (nn.Conv2d,)  # its Conv1d and Conv3d samplers read channels-last inputs right


def _contiguous_input(_module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook: the layer's input in contiguous memory (a copy only when it is not), before Opacus records
    it."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].is_contiguous():
        return None
    return (args[0].contiguous(), *args[1:])


def contiguous_conv_inputs(module: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Give every Conv2d whose per-sample gradients Opacus computes a contiguous input (channels-last models
    keep their layout elsewhere); returns the hooks' handles."""
    return [
        m.register_forward_pre_hook(_contiguous_input) for m in module.modules() if type(m) in _OPACUS_STRIDED_CONVS
    ]


def make_private(
    privacy_engine: Any,
    *,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: Any,
    example_input: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """``privacy_engine.make_private(...)`` after ``check_dp_safe(module, example_input, data_loader.batch_size)``,
    with every training forward of ``module``, and the backward before each optimizer step, guarded against writes
    to buffers and frozen parameters (buffer_guard.py), and every Conv2d given a contiguous input (Opacus'
    samplers misread a channels-last one: ``contiguous_conv_inputs``). Batch shapes other than the loader's are
    not probed for mixing here (equiconvert's own make_private probes each).

    example_input defaults to random values of the shape and dtype of the first example of
    ``data_loader.dataset`` (its values are not used: the check sees no training data; no batch is drawn).
    Raises ForeignParametersError when the optimizer holds parameters that are not the module's (an optimizer
    built before the conversion line), PrivacyValidationError, naming the module, for a model DP-SGD cannot
    train, and warns when the engine's randomness is not secure (Opacus' secure_mode off).
    """
    check_optimizer_params(module, optimizer, caller="opacus_interop.make_private", frozen_too=True)
    if example_input is None:
        example = torch.as_tensor(data_loader.dataset[0][0])
        shaped = torch.rand_like(example) if example.is_floating_point() else torch.zeros_like(example)
        example_input = shaped.unsqueeze(0)
    set_once = check_dp_safe(module, example_input, getattr(data_loader, "batch_size", None))
    guard = BufferGuard(module, set_once)
    guard.attach()  # each training forward: no buffer or frozen parameter may keep anything of the batch
    optimizer.register_step_pre_hook(lambda *_: guard.check("in a training backward"))  # nor a backward hook
    contiguous_conv_inputs(module)  # Opacus' conv samplers misread channels-last inputs
    if not getattr(privacy_engine, "secure_mode", False):
        warnings.warn(OPACUS_NOT_SECURE, UserWarning, stacklevel=2)
    return privacy_engine.make_private(module=module, optimizer=optimizer, data_loader=data_loader, **kwargs)
