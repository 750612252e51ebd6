"""Ghost clipping on book-keeping's per-layer rules: the clipped sum without every per-example gradient at once.

Book-keeping (bookkeeping.py) forms every parameter's per-example gradient before clipping: B copies of the
model's gradient at once. Here the batch runs through one forward (parameters frozen, each parametrised layer's
input kept, as book-keeping) and one backward that computes activation gradients only and keeps each layer's
output gradient (the graph is freed as it goes); then each layer's input and output gradient are read twice:

1. the layer's per-example gradient is formed by book-keeping's rule for a slice of the examples at a time
   (SLICE_BYTES), reduced to each example's squared norm and whether it is finite, and dropped;
2. the whole gradients' norms give the clip factors (dp_step.py); the output gradient with each example's rows
   scaled by its factor (a non-finite example's rows, and its inputs, zeroed) pulled back through the layer alone
   is the layer's clipped sum: an ordinary weight gradient, with no per-example dimension. The layer's input and
   output gradient are released once its sum is taken.

The norms are book-keeping's, exact for every layer type it serves (steerable convs: the norm of the basis
coefficients' gradient, as DP-SGD clips), and the norms and the sum read the same output gradients, so the clip
bound holds to the rounding of one fp32 product. The back-end is registered for fp32; its bf16 path is not yet
checked against book-keeping's. Peak memory is that of a non-private step's forward and backward (activations,
then the layers' inputs and output gradients) plus one slice of one layer's per-example gradient.
"""

from __future__ import annotations

from collections.abc import Collection, MutableMapping

import torch
from torch import nn
from torch.func import functional_call
from torch.profiler import record_function

from ..nn.conv import SteerableConv2d
from .bookkeeping import (
    BookkeepingUnsupportedError,
    LayerRecord,
    check_inputs_unchanged,
    layer_per_example_gradients,
    parameters_frozen,
    parametrised_layers,
    recorded_losses,
)
from .dp_step import add_into, clip_factors
from .nonfinite import kept_and_nonfinite
from .per_sample import LossFn

SLICE_BYTES = 1 << 26  # one layer's per-example gradients of at most this many bytes at a time (a slice of examples)


def trainable_names(module: nn.Module) -> tuple[str, ...]:
    """The layer's own trainable parameters (read before the passes freeze them)."""
    return tuple(name for name, p in module.named_parameters(recurse=False) if p.requires_grad)


def _per_example_bytes(module: nn.Module) -> int:
    """Bytes of one example's gradient of the layer, with the dense filter a (steerable) conv's rule forms first."""
    numel = sum(p.numel() for p in module.parameters(recurse=False))
    if isinstance(module, SteerableConv2d):
        numel += module.out_channels * module.in_channels // module.groups * module.kernel_size**2
    return numel * next(module.parameters(recurse=False)).element_size()


def _in_parameter_dtype(module: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """Float tensors in the layer's parameter dtype (the products of both passes); indices (embeddings) as they are."""
    dtype = next(module.parameters(recurse=False)).dtype
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def layer_squared_norms(
    module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor, views: int, trainable: Collection[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's squared gradient norm over the layer's `trainable` parameters, and whether it is finite:
    (B,) twice.

    The per-example gradients are book-keeping's, formed a slice of the examples at a time and dropped.
    """
    batch = inputs.shape[0] // views
    step = max(1, min(batch, SLICE_BYTES // max(1, _per_example_bytes(module))))
    inputs, grad_out = _in_parameter_dtype(module, inputs), _in_parameter_dtype(module, grad_out)
    squares, finite = [], []
    for start in range(0, batch, step):
        rows = slice(start * views, min(batch, start + step) * views)
        grads = layer_per_example_gradients(module, inputs[rows], grad_out[rows], views)
        flat = [g.reshape(g.shape[0], -1) for name, g in grads.items() if name in trainable]
        squares.append(torch.stack([torch.linalg.vector_norm(f, dim=1).square() for f in flat]).sum(0))  # no copy
        finite.append(torch.stack([torch.isfinite(f).all(1) for f in flat]).all(0))
    return torch.cat(squares), torch.cat(finite)


def layer_clipped_sum(
    module: nn.Module,
    inputs: torch.Tensor,
    grad_out: torch.Tensor,
    row_weights: torch.Tensor,
    trainable: Collection[str],
) -> dict[str, torch.Tensor]:
    """The layer's weight gradient with each row's output gradient scaled by `row_weights` (B*K,): rows of weight 0,
    and their inputs, are zeroed first, so a non-finite example adds nothing (not 0 * NaN)."""
    inputs, grad_out = _in_parameter_dtype(module, inputs), _in_parameter_dtype(module, grad_out)
    keep = row_weights != 0
    if inputs.is_floating_point():
        inputs = torch.where(keep.view(-1, *[1] * (inputs.dim() - 1)), inputs, 0.0)
    weights = row_weights.to(grad_out.dtype).view(-1, *[1] * (grad_out.dim() - 1))
    grad_out = torch.where(weights != 0, grad_out * weights, 0.0)
    params = {name: getattr(module, name).detach().requires_grad_(True) for name in trainable}
    with torch.enable_grad(), torch.autocast(inputs.device.type, enabled=False):
        output = functional_call(module, params, (inputs,))
        sums = torch.autograd.grad(output, list(params.values()), grad_out)
    return dict(zip(params, sums))


def recorded_clipped_sum(
    record: LayerRecord,
    views: int,
    scale: float,
    max_grad_norm: float,
    into: MutableMapping[nn.Parameter, torch.Tensor],
    real: torch.Tensor | None = None,
) -> torch.Tensor:
    """The clipped sum of a forward and backward the caller ran (make_private's loop), from `record`'s layer inputs
    and output gradients: add it to `into` by parameter (in place); returns how many examples were non-finite.
    `real` (B,): False on blank padding rows, which add zero and are not counted (nonfinite.py).

    The output gradients are those of the caller's reduced loss; `scale` turns a layer's per-example gradient from
    them into the gradient of the example's mean loss over its `views` rows. One backward suffices: each layer's
    output gradient is kept (as book-keeping keeps it), so the norms and the sum read the same one. Each layer's
    input and output gradient leave `record` once its sum is taken.
    """
    trainable = {name: trainable_names(layer) for name, layer in record.layers.items()}
    squares, finite = [], []
    for name, layer in record.layers.items():
        with record_function(f"equiconvert/ghost_norms/{type(layer).__name__}"):
            layer_squares, layer_finite = layer_squared_norms(
                layer, record.inputs[name], record.grads[name], views, trainable[name]
            )
        squares.append(layer_squares)
        finite.append(layer_finite)
    kept, nonfinite = kept_and_nonfinite(torch.stack(finite).all(0), real)
    norms = torch.stack(squares).sum(0).sqrt() * scale
    row_weights = (torch.where(kept, clip_factors(norms, max_grad_norm), 0.0) * scale).repeat_interleave(views)
    for name, layer in record.layers.items():
        inputs, grad = record.inputs.pop(name), record.grads.pop(name)
        with record_function(f"equiconvert/ghost_sum/{type(layer).__name__}"):
            sums = layer_clipped_sum(layer, inputs, grad, row_weights, trainable[name])
        add_into(into, {getattr(layer, param_name): value for param_name, value in sums.items()})
    return nonfinite


def accumulate_clipped_ghost(
    model: nn.Module,
    views: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: LossFn,
    max_grad_norm: float,
    into: MutableMapping[str, torch.Tensor],
    real: torch.Tensor | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the sum of each example's gradient of its mean loss over its K views, clipped to max_grad_norm, to `into`
    (by parameter name, in place); an example with a non-finite gradient, or a blank row (`real` False), adds zero
    (nonfinite.py).

    views (B, K, C, H, W) -> (losses (B,), how many examples were non-finite (a device tensor)). One forward and
    one backward that computes activation gradients only; the graph is freed by that backward, and each layer's
    kept input and output gradient are then read twice by recorded_clipped_sum (norms, then the clipped sum).
    """
    record = LayerRecord(parametrised_layers(model), twice="use the vmap method")
    with parameters_frozen(model):
        inputs, losses = recorded_losses(model, record, views, labels, loss_fn, autocast_dtype)
        check_inputs_unchanged(record)
        with record_function("equiconvert/ghost_backward"):
            torch.autograd.grad(losses.sum(), inputs)
    if missing := [name for name in record.layers if name not in record.grads]:
        raise BookkeepingUnsupportedError(f"layers {missing} did not take part in the forward pass")
    names = {param: name for name, param in model.named_parameters() if param.requires_grad}
    by_parameter: dict[nn.Parameter, torch.Tensor] = {}
    nonfinite = recorded_clipped_sum(record, views.shape[1], 1.0, max_grad_norm, by_parameter, real)
    add_into(into, {names[param]: value for param, value in by_parameter.items()})
    return losses.detach(), nonfinite
