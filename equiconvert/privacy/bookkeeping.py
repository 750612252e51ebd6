"""Per-sample gradients by book-keeping (Bu et al. 2023): one ordinary forward and backward.

`torch.func.vmap(grad)` runs a per-example copy of the whole backward, including a
per-example weight gradient of every convolution through a grouped convolution. Here
the network runs once on all B*K views; the backward computes activation gradients
only (parameters are detached for it), and every layer that owns parameters keeps its
input and receives the gradient of its output. Its per-example parameter gradient is
then formed from those two:

- convolutions (plain, steerable and between direct sums) and linear layers: batched matrix products of the
  output gradient with the input (stride-1 convs: one per filter tap on a shifted view of
  the input, no unfolding), summed over the example's K views; a
  steerable filter gradient then goes to coefficient space by the transpose of the
  basis expansion and the vector-Jacobian product of the weight standardization;
- GroupNorm: the output gradient times the normalised input, recomputed in one pass;
- any other layer with parameters (equiconvert's field norms): the vmapped vector-Jacobian
  product of that layer alone, on the example's K inputs.

The result equals `per_sample.per_sample_gradients` (each example's gradient of its mean
loss over its K views). Under bf16 autocast (`autocast_dtype`) the forward and backward run
in bf16 where autocast puts them and each layer's products take the operands it computed
with; every per-example gradient is returned in its parameter's dtype, so norms, clipping
and noise stay in fp32: the sensitivity bound holds for whatever each example's gradient is.
It needs every parametrised layer to run once per forward and to own its parameters;
`check_bookkeeping_supported` says why a model does not qualify.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.profiler import record_function

from ..errors import UsageError
from ..nn.conv import SteerableConv2d
from ..nn.direct_sum import DirectSumConv2d
from .filter_gradients import per_example_filter_gradients, steerable_weight_gradients
from .per_sample import Gradients, LossFn, per_sample_gradients

PerSampleRule = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], dict[str, torch.Tensor]]


class BookkeepingUnsupportedError(UsageError, ValueError):
    """The model cannot use book-keeping; the message names the layer and says why."""


def _filter_gradients(module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor, views: int) -> torch.Tensor:
    """Per-example gradient of the layer's dense filter, (B, C_out, C_in, kh, kw), summed over each example's views."""
    return per_example_filter_gradients(
        inputs,
        grad_out,
        views,
        kernel=module.kernel_size,
        stride=module.stride,
        padding=module.padding,
        dilation=module.dilation,
        padding_mode=getattr(module, "padding_mode", "zeros"),  # DirectSumConv2d pads with zeros only
    )


def _channel_sums(grad_out: torch.Tensor, batch: int, views: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-example gradient of a per-channel conv bias, (B, C_out): the output gradient summed over views and positions.

    Accumulated and returned in `dtype` (the bias's) without a copy of a bf16 gradient in fp32 first; positions
    first (a reduction over each view's contiguous rows), then views.
    """
    per_view = grad_out.reshape(grad_out.shape[0], grad_out.shape[1], -1).sum(dim=-1, dtype=dtype)
    return per_view.reshape(batch, views, -1).sum(dim=1)


def _conv_rule(module: nn.Conv2d, inputs: torch.Tensor, grad_out: torch.Tensor, views: int) -> dict[str, torch.Tensor]:
    filters = _filter_gradients(module, inputs, grad_out, views)
    # one pass: `.to` alone keeps a strided view's strides, and a `.contiguous()` after it would copy again
    grads = {"weight": filters.to(module.weight.dtype, memory_format=torch.contiguous_format)}
    if module.bias is not None:
        grads["bias"] = _channel_sums(grad_out, filters.shape[0], views, module.bias.dtype)
    return grads


def _steerable_conv_rule(
    module: SteerableConv2d, inputs: torch.Tensor, grad_out: torch.Tensor, views: int
) -> dict[str, torch.Tensor]:
    filters = _filter_gradients(module, inputs, grad_out, views)
    grads = {"weight": steerable_weight_gradients(module, filters)}
    if module.bias is not None:
        _, bias_vjp = vjp(module.expand_bias, module.bias.detach())
        channel_sums = _channel_sums(grad_out, filters.shape[0], views, module.bias.dtype)
        grads["bias"] = vmap(lambda g: bias_vjp(g)[0])(channel_sums)
    return grads


def _direct_sum_conv_rule(
    module: DirectSumConv2d, inputs: torch.Tensor, grad_out: torch.Tensor, views: int
) -> dict[str, torch.Tensor]:
    """One per-example filter gradient for the whole block matrix, cut into its (output part, input part) blocks,
    each contracted with its own basis (the transpose of DirectSumConv2d.expand_filter)."""
    filters = _filter_gradients(module, inputs, grad_out, views)
    batch, k = filters.shape[0], module.kernel_size
    out_edges = _part_edges(module.out_fields, module.out_sizes)
    in_edges = _part_edges(module.in_fields, module.in_sizes)
    grads = {}
    for j, i in module.blocks:
        block = filters[:, out_edges[j] : out_edges[j + 1], in_edges[i] : in_edges[i + 1]].reshape(
            batch, module.out_fields[j], module.out_sizes[j], module.in_fields[i], module.in_sizes[i], k, k
        )
        basis = module.basis(j, i).to(filters.dtype)
        grads[f"weight_{j}_{i}"] = torch.einsum("bxsyijk,nsijk->bxyn", block, basis).to(module.weight(j, i).dtype)
    if module.bias_0 is not None:
        sums = _channel_sums(grad_out, batch, views, module.bias_0.dtype) * module.bias_scale
        for j, (fields, size) in enumerate(zip(module.out_fields, module.out_sizes)):
            grads[f"bias_{j}"] = sums[:, out_edges[j] : out_edges[j + 1]].reshape(batch, fields, size).sum(-1)
    return grads


def _part_edges(fields: tuple[int, ...], sizes: tuple[int, ...]) -> list[int]:
    """Channel offsets where each part of a direct sum starts, and the end."""
    edges = [0]
    for count, size in zip(fields, sizes):
        edges.append(edges[-1] + count * size)
    return edges


def _linear_rule(
    module: nn.Linear, inputs: torch.Tensor, grad_out: torch.Tensor, views: int
) -> dict[str, torch.Tensor]:
    batch = inputs.shape[0] // views
    inputs = inputs.reshape(batch, -1, inputs.shape[-1])  # views and any middle dimensions together
    grad_out = grad_out.reshape(batch, -1, grad_out.shape[-1])
    grads = {"weight": torch.einsum("bno,bni->boi", grad_out, inputs).to(module.weight.dtype)}
    if module.bias is not None:
        grads["bias"] = grad_out.to(module.bias.dtype).sum(dim=1)
    return grads


def _layer_vjp_rule(
    module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor, views: int
) -> dict[str, torch.Tensor]:
    """Any layer that owns its parameters: the VJP of the layer alone, per example, on its K inputs."""
    params = {name: p.detach() for name, p in module.named_parameters(recurse=False)}
    batch = inputs.shape[0] // views

    def example(example_inputs: torch.Tensor, example_grad: torch.Tensor) -> dict[str, torch.Tensor]:
        _, pullback = vjp(lambda p: functional_call(module, p, (example_inputs,)), params)
        return pullback(example_grad)[0]

    return vmap(example)(
        inputs.reshape(batch, views, *inputs.shape[1:]), grad_out.reshape(batch, views, *grad_out.shape[1:])
    )


def _group_norm_rule(
    module: nn.GroupNorm, inputs: torch.Tensor, grad_out: torch.Tensor, views: int
) -> dict[str, torch.Tensor]:
    """Per-example gradient of GroupNorm's per-channel scale and shift, without a per-example VJP.

    The scale's is the output gradient times the normalised input (recomputed in one pass over the batch), the
    shift's the output gradient, each summed over the example's views and positions; in the parameters' dtype.
    """
    batch, dtype = inputs.shape[0] // views, module.weight.dtype
    gradient = grad_out.to(dtype)
    normalized = F.group_norm(inputs.to(dtype), module.num_groups, eps=module.eps)
    per_view = {"weight": (gradient * normalized).flatten(2).sum(-1), "bias": gradient.flatten(2).sum(-1)}
    return {name: sums.reshape(batch, views, -1).sum(dim=1) for name, sums in per_view.items()}


def _embedding_rule(
    module: nn.Embedding, indices: torch.Tensor, grad_out: torch.Tensor, views: int
) -> dict[str, torch.Tensor]:
    """Per-example gradient of an embedding table: each example's output gradients added into the rows it looked up."""
    batch = indices.shape[0] // views
    rows = indices.reshape(batch, -1)
    grad_out = grad_out.reshape(batch, -1, grad_out.shape[-1]).to(module.weight.dtype)
    weight = grad_out.new_zeros(batch, *module.weight.shape)
    weight.scatter_add_(1, rows.unsqueeze(-1).expand(-1, -1, grad_out.shape[-1]), grad_out)
    if module.padding_idx is not None:
        weight[:, module.padding_idx] = 0  # the padding row receives no gradient, as in nn.Embedding's backward
    return {"weight": weight}


RULES: dict[type[nn.Module], PerSampleRule] = {
    SteerableConv2d: _steerable_conv_rule,
    DirectSumConv2d: _direct_sum_conv_rule,
    nn.Conv2d: _conv_rule,
    nn.Linear: _linear_rule,
    nn.Embedding: _embedding_rule,
    nn.GroupNorm: _group_norm_rule,
}


def _rule_for(module: nn.Module) -> PerSampleRule:
    rule = RULES.get(type(module), _layer_vjp_rule)
    if rule is not _layer_vjp_rule and (
        getattr(module, "groups", 1) != 1 or isinstance(getattr(module, "padding", 0), str)
    ):
        return _layer_vjp_rule  # grouped convs, padding="same": exact through the generic VJP
    return rule


def parametrised_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Layers that own trainable parameters, by module path."""
    return {name: m for name, m in model.named_modules() if any(p.requires_grad for p in m.parameters(recurse=False))}


def check_bookkeeping_supported(model: nn.Module) -> None:
    """Raise BookkeepingUnsupportedError unless every parameter is owned by one layer with no parametrised children."""
    owners: dict[int, str] = {}
    for name, module in parametrised_layers(model).items():
        for param in module.parameters(recurse=False):
            if id(param) in owners:
                raise BookkeepingUnsupportedError(f"parameter shared by layers {owners[id(param)]!r} and {name!r}")
            owners[id(param)] = name
        if _rule_for(module) is _layer_vjp_rule and any(
            p.requires_grad for child in module.children() for p in child.parameters()
        ):
            raise BookkeepingUnsupportedError(
                f"layer {name!r} ({type(module).__name__}) owns parameters and has "
                "parametrised sub-layers; use the vmap method"
            )


@dataclass
class LayerRecord:
    """One forward's layer inputs and (after backward) output gradients, by layer path: what the per-layer rules
    take. `twice` says what to do where a layer runs more than once in a forward (its caller's remedy)."""

    layers: dict[str, nn.Module]
    twice: str
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)  # of each kept input: an in-place change shows

    @contextlib.contextmanager
    def attached(self) -> Iterator[LayerRecord]:
        """Forward hooks on every layer, for the length of the block."""
        handles = [layer.register_forward_hook(self._hook(name)) for name, layer in self.layers.items()]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, name: str) -> Callable[[nn.Module, tuple, Any], torch.Tensor | None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> torch.Tensor | None:
            if name in self.inputs:
                raise BookkeepingUnsupportedError(f"layer {name!r} runs more than once per forward; {self.twice}")
            if len(args) != 1 or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
                raise BookkeepingUnsupportedError(
                    f"layer {name!r} ({type(module).__name__}) must take and return one tensor"
                )
            self.inputs[name] = args[0].detach()  # shares the version counter of args[0]
            self.versions[name] = args[0]._version
            replaced = None
            if not output.requires_grad:  # nothing before this layer needs a gradient: the backward starts here
                # a copy of a fresh leaf, so that in-place ops after the layer (ReLU(inplace=True)) stay allowed
                output = replaced = output.detach().requires_grad_(True).clone()
            output.register_hook(lambda grad: self._keep_grad(name, grad))
            return replaced

        return hook

    def _keep_grad(self, name: str, grad: torch.Tensor) -> None:
        self.grads[name] = grad

    def inputs_changed(self) -> list[str]:
        """Layers whose kept input was modified in place after they ran: their gradients would be wrong."""
        return [name for name, kept in self.inputs.items() if kept._version != self.versions[name]]


@contextlib.contextmanager
def parameters_frozen(model: nn.Module) -> Iterator[None]:
    """The backward computes activation gradients only: no parameter gradient is formed or accumulated."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _rule_operands(
    module: nn.Module, rule: PerSampleRule, inputs: torch.Tensor, grad_out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's input and output gradient in the dtypes its rule computes with.

    Products (conv, linear rules) take the input in the dtype the layer computed its output in
    (bf16 under autocast: what the layer itself multiplied); the generic VJP re-runs the layer,
    so it gets both in its parameters' dtype. The conv rules' filter-gradient kernels cast the
    input themselves, as they lay it out (one pass over it instead of two).
    """
    if rule is _layer_vjp_rule:
        dtype = next(module.parameters(recurse=False)).dtype
        return inputs.to(dtype), grad_out.to(dtype)
    if rule in (_conv_rule, _steerable_conv_rule, _embedding_rule):  # embedding inputs are indices
        return inputs, grad_out
    return inputs.to(grad_out.dtype), grad_out


def layer_per_example_gradients(
    module: nn.Module, inputs: torch.Tensor, grad_out: torch.Tensor, views: int
) -> dict[str, torch.Tensor]:
    """One layer's per-example parameter gradients from its kept input and output gradient, summed over views."""
    rule = _rule_for(module)
    return rule(module, *_rule_operands(module, rule, inputs, grad_out), views)


def recorded_losses(
    model: nn.Module,
    record: LayerRecord,
    views: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: LossFn,
    autocast_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of all B*K views with `record` attached (under autocast in autocast_dtype where given), and each
    example's mean loss over its views: (the input rows, which require grad for the backward; losses (B,))."""
    batch, num_views = views.shape[:2]
    inputs = views.reshape(batch * num_views, *views.shape[2:]).detach().requires_grad_(True)
    autocast = torch.autocast(views.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with record.attached(), autocast, record_function("equiconvert/forward"):
        logits = model(inputs)
    if autocast_dtype is not None:
        logits = logits.float()  # the loss in fp32, as autocast itself would compute it
    per_view = loss_fn(logits, labels.repeat_interleave(num_views), reduction="none")
    return inputs, per_view.reshape(batch, num_views).mean(dim=1)


def check_inputs_unchanged(record: LayerRecord) -> None:
    """Refuse a forward that modified a kept layer input in place: that layer's gradients would be wrong."""
    if changed := record.inputs_changed():
        raise BookkeepingUnsupportedError(
            f"the inputs of layers {changed} are modified in place after those layers run; make that operation "
            "out of place, or use the vmap method"
        )


def per_sample_gradients_bookkeeping(
    model: nn.Module,
    views: torch.Tensor,
    labels: torch.Tensor,
    loss_fn: LossFn = F.cross_entropy,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[Gradients, torch.Tensor]:
    """Each example's gradient of its mean loss over its K views, and that loss (as per_sample_gradients).

    views (B, K, C, H, W) -> ({parameter name: (B, *shape)}, (B,)). autocast_dtype (torch.bfloat16):
    run the forward under autocast in that dtype; the gradients come back in the parameters' dtype.
    """
    num_views = views.shape[1]
    layers = parametrised_layers(model)
    record = LayerRecord(layers, twice="use the vmap method")
    with parameters_frozen(model):
        inputs, losses = recorded_losses(model, record, views, labels, loss_fn, autocast_dtype)
        with record_function("equiconvert/backward"):
            torch.autograd.grad(losses.sum(), inputs)
    check_inputs_unchanged(record)
    grads: Gradients = {}
    for name, module in layers.items():
        if name not in record.grads:
            raise BookkeepingUnsupportedError(f"layer {name!r} did not take part in the forward pass")
        with record_function(f"equiconvert/per_example/{type(module).__name__}"):
            per_layer = layer_per_example_gradients(module, record.inputs[name], record.grads[name], num_views)
        for param_name, value in per_layer.items():
            grads[f"{name}.{param_name}" if name else param_name] = value
    order = [name for name, p in model.named_parameters() if p.requires_grad]
    return {name: grads[name] for name in order}, losses.detach()


def verify_bookkeeping(model: nn.Module, view_shape: tuple[int, ...], loss_fn: LossFn = F.cross_entropy) -> None:
    """Raise BookkeepingUnsupportedError unless book-keeping is exact and keeps examples apart on this model.

    Book-keeping runs the whole batch through one forward, so unlike vmap it relies on the model
    not mixing examples; `validate_dp_safe` refuses known batch-statistics layers, but a layer
    may compute them functionally, or use a parameter outside the layer that owns it. This probe,
    on a float64 CPU copy of the model and random inputs (no data, no RNG state of the caller
    used or changed), checks that (train mode) example 0's gradient ignores the other examples
    of its batch and (eval mode) book-keeping's gradients equal torch.func's. view_shape is
    (K, C, H, W) of one example's views.
    """
    probe = copy.deepcopy(model).to(device="cpu", dtype=torch.float64)
    inputs = torch.Generator().manual_seed(0)
    views_per_example = min(view_shape[0], 2)  # enough to exercise the sum over views; keeps the probe cheap
    views = torch.randn(3, views_per_example, *view_shape[1:], generator=inputs, dtype=torch.float64)
    others = views.clone()
    others[1:] = torch.randn(others[1:].shape, generator=inputs, dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):
        probe.train()
        torch.default_generator.manual_seed(0)  # the same dropout masks in both runs
        num_classes = probe(views[:1, 0]).shape[-1]
        labels = torch.arange(3) % num_classes
        torch.default_generator.manual_seed(0)
        first, _ = per_sample_gradients_bookkeeping(probe, views, labels, loss_fn)
        torch.default_generator.manual_seed(0)
        changed, _ = per_sample_gradients_bookkeeping(probe, others, labels, loss_fn)
    for name in first:
        if not torch.allclose(first[name][0], changed[name][0], rtol=1e-9, atol=1e-12):
            raise BookkeepingUnsupportedError(
                f"an example's gradient of {name!r} changes with the other examples of its batch: a layer mixes "
                "examples (batch statistics?); book-keeping runs the batch through one forward, vmap does not"
            )
    probe.eval()
    params = {n: p.detach() for n, p in probe.named_parameters() if p.requires_grad}
    exact, _ = per_sample_gradients(probe, params, dict(probe.named_buffers()), views, labels, loss_fn)
    kept, _ = per_sample_gradients_bookkeeping(probe, views, labels, loss_fn)
    for name, value in kept.items():  # trainable parameters only; torch.func also differentiates frozen ones
        error = float((value - exact[name]).norm() / exact[name].norm().clamp_min(1e-30))
        if error > 1e-8:
            raise BookkeepingUnsupportedError(
                f"book-keeping's gradient of {name!r} differs from torch.func's by {error:.1e} (relative): a "
                "parameter used outside the layer that owns it?"
            )
