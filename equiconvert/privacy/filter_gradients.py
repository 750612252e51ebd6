"""Per-example gradients of a dense conv filter from the layer's input and output gradient.

Book-keeping and the Opacus grad sampler of SteerableConv2d both need, for every example,
the filter gradient sum over its views and positions of (output gradient x input patch).
Five kernels compute it, and which is fastest depends on the layer's shape and the card
(benchmarks/filter_gradients.py, bf16 on an H200, the paper model's convs at 2048 x 4 views:
"triton" wins at 3 -> 48 channels and 32x32 and at 156 -> 156 and 4x4, "triton_taps" at
48 -> 104 and 32x32, "grouped" and "triton_taps" are within 3% at 104 -> 104 and 16x16,
"products" wins on the other two):

- "products": batched matrix products. Stride-1 convolutions run one product per filter
  tap on a shifted, strided view of the padded input; unfolding the input into patches
  (the other geometries) copies it k*k times and is memory-bound on a GPU.
- "grouped": the weight gradient of one convolution whose groups are the examples
  (cuDNN on a GPU), with the views as its batch.
- "unfolded": stride-1 convolutions only (the other geometries as "products"): every tap's
  input stacked in the products' aligned layout, then one wide product per slice of examples,
  which reads the output gradient once instead of once per tap, at the cost of a k*k-fold
  copy of the input (a slice of the batch at a time, so memory stays bounded).
- "triton" and "triton_taps": ungrouped convs only (grouped ones as "products"), CUDA only: a
  Triton kernel that reads the patches straight from the input, an implicit GEMM per example, tiled
  over (input channel, tap) columns or over the input channels of one tap (triton_filter_gradients.py).

The method in force (`filter_gradient_method`) is "auto" unless a caller says otherwise:
"fastest" on CUDA, which times every kernel that can run there once per layer geometry and
device, on random stand-ins of a public batch size (TIMING_EXAMPLES, or DPTrainer's physical batch),
and keeps the fastest, and "grouped" elsewhere (oneDNN's grouped weight gradient on a 2-core CPU was
1.3-6.7x faster than the products on each of the paper model's six convs;
docs/guides/performance.md), a fixed choice so that CPU results never
depend on a timing (a resumed run repeats its kernels bit for bit).
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ..errors import ParameterError
from ..nn.conv import SteerableConv2d
from .triton_filter_gradients import KERNEL_FAILURES, triton_filter_gradients, triton_kernel_usable

IntPair = int | tuple[int, int]


def pair(value: IntPair) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


@dataclass(frozen=True)
class ConvGeometry:
    """A convolution's shape parameters, padding already applied to the input unless it is zero padding."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int

    def check_output_size(self, inputs: torch.Tensor, grad_out: torch.Tensor) -> None:
        """A clear error when grad_out's spatial size is not this conv's output size for inputs (every kernel)."""
        expected = tuple(
            (size + 2 * pad - dil * (k - 1) - 1) // step + 1
            for size, pad, dil, k, step in zip(inputs.shape[-2:], self.padding, self.dilation, self.kernel, self.stride)
        )
        if tuple(grad_out.shape[-2:]) != expected:
            raise ParameterError(
                f"output gradient of size {tuple(grad_out.shape[-2:])} does not fit a {self.kernel[0]}x{self.kernel[1]} "
                f"conv (stride {self.stride}, padding {self.padding}, dilation {self.dilation}) of a "
                f"{tuple(inputs.shape[-2:])} input, whose output is {expected}"
            )

    @property
    def dense_stride1(self) -> bool:
        """Stride 1, no dilation, no groups: the case the grid-layout kernels handle without unfolding."""
        return self.stride == (1, 1) and self.dilation == (1, 1) and self.groups == 1


FilterGradientKernel = Callable[[torch.Tensor, torch.Tensor, int, ConvGeometry], torch.Tensor]


def per_example_filter_gradients(
    inputs: torch.Tensor,
    grad_out: torch.Tensor,
    views: int,
    *,
    kernel: IntPair,
    stride: IntPair = 1,
    padding: IntPair = 0,
    dilation: IntPair = 1,
    padding_mode: str = "zeros",
    groups: int = 1,
) -> torch.Tensor:
    """(B, C_out, C_in/groups, kh, kw): each example's filter gradient of a conv, summed over its K views.

    inputs (B*K, C_in, H, W) and grad_out (B*K, C_out, H', W') hold each example's K views
    consecutively; neither is differentiated through. The products run in grad_out's dtype
    (inputs in another, such as fp32 activations under bf16 autocast, are cast on the way).
    The result may be a strided view: consumers reshape it once, into the layout they need.
    """
    padding = pair(padding)
    inputs, grad_out = inputs.detach(), grad_out.detach()
    if padding_mode != "zeros":  # the layer pads with F.pad, then convolves without padding
        inputs = F.pad(inputs, (padding[1], padding[1], padding[0], padding[0]), mode=padding_mode)
        padding = (0, 0)
    geometry = ConvGeometry(pair(kernel), pair(stride), padding, pair(dilation), groups)
    geometry.check_output_size(inputs, grad_out)
    return KERNELS[_kernel_for(inputs, grad_out, views, geometry)](inputs, grad_out, views, geometry)


def _products(inputs: torch.Tensor, grad_out: torch.Tensor, views: int, geometry: ConvGeometry) -> torch.Tensor:
    """Batched products: one per filter tap for stride-1 ungrouped convs, one einsum over the patches otherwise."""
    g = geometry
    if g.dense_stride1:
        return _shifted_products(inputs, grad_out, views, g.kernel, g.padding)
    patches = _patches(inputs.to(grad_out.dtype), g)  # (N, C_in, H', W', kh, kw)
    batch, channels_in, channels_out = inputs.shape[0] // views, inputs.shape[1], grad_out.shape[1]
    patches = patches.reshape(batch, views, g.groups, channels_in // g.groups, *patches.shape[2:])
    grad_out = grad_out.reshape(batch, views, g.groups, channels_out // g.groups, *grad_out.shape[2:])
    dense = torch.einsum("bkgohw,bkgdhwij->bgodij", grad_out, patches)
    return dense.reshape(batch, channels_out, channels_in // g.groups, *g.kernel)


def _patches(inputs: torch.Tensor, geometry: ConvGeometry) -> torch.Tensor:
    """(N, C, H', W', kh, kw): every output position's input patch, a strided view of the zero-padded input.

    Unlike F.unfold, whose CUDA kernel is launched once per image (thousands of launches for a batch of views),
    the view costs no kernel; the einsum that reads it copies it once.
    """
    (ph, pw), (kh, kw), (sh, sw), (dh, dw) = geometry.padding, geometry.kernel, geometry.stride, geometry.dilation
    padded = F.pad(inputs, (pw, pw, ph, ph)) if ph or pw else inputs
    windows = padded.unfold(2, (kh - 1) * dh + 1, sh).unfold(3, (kw - 1) * dw + 1, sw)
    return windows[..., ::dh, ::dw]


def _grouped_convolution(
    inputs: torch.Tensor, grad_out: torch.Tensor, views: int, geometry: ConvGeometry
) -> torch.Tensor:
    """The weight gradient of one convolution with B * groups groups (example-major) and the K views as its batch."""
    g = geometry
    inputs = inputs.to(grad_out.dtype)
    total, channels_in, height, width = inputs.shape
    batch, channels_out = total // views, grad_out.shape[1]
    by_view = inputs.reshape(batch, views, channels_in, height, width).transpose(0, 1)
    grad_by_view = grad_out.reshape(batch, views, channels_out, *grad_out.shape[2:]).transpose(0, 1)
    weight = inputs.new_empty(batch * channels_out, channels_in // g.groups, *g.kernel)
    filters = torch.ops.aten.convolution_backward(
        grad_by_view.reshape(views, batch * channels_out, *grad_out.shape[2:]),
        by_view.reshape(views, batch * channels_in, height, width),
        weight,
        None,
        list(g.stride),
        list(g.padding),
        list(g.dilation),
        False,
        [0, 0],
        batch * g.groups,
        [False, True, False],
    )[1]
    return filters.view(batch, channels_out, channels_in // g.groups, *g.kernel)


def _unfolded(inputs: torch.Tensor, grad_out: torch.Tensor, views: int, geometry: ConvGeometry) -> torch.Tensor:
    """Stride-1 ungrouped convs: the taps stacked (see _unfolded_products); other geometries as "products"."""
    g = geometry
    if g.dense_stride1:
        return _unfolded_products(inputs, grad_out, views, g.kernel, g.padding)
    return _products(inputs, grad_out, views, geometry)


def _triton_kernel(layout: str) -> FilterGradientKernel:
    """Ungrouped convs: a Triton kernel of the given tiling (any stride, padding, dilation); grouped ones as "products"."""

    def kernel(inputs: torch.Tensor, grad_out: torch.Tensor, views: int, geometry: ConvGeometry) -> torch.Tensor:
        g = geometry
        if g.groups != 1:
            return _products(inputs, grad_out, views, geometry)
        return triton_filter_gradients(
            inputs,
            grad_out,
            views,
            layout=layout,
            kernel=g.kernel,
            stride=g.stride,
            padding=g.padding,
            dilation=g.dilation,
        )

    return kernel


KERNELS: dict[str, FilterGradientKernel] = {
    "products": _products,
    "grouped": _grouped_convolution,
    "unfolded": _unfolded,
    "triton": _triton_kernel("patch columns"),
    "triton_taps": _triton_kernel("one tap"),
}
RUNS_ON: dict[str, Callable[[torch.Tensor, torch.Tensor], bool]] = {  # kernels that cannot run on every tensor
    "triton": triton_kernel_usable,
    "triton_taps": triton_kernel_usable,
}
FILTER_GRADIENT_METHODS = ("auto", "fastest", *KERNELS)

# "fastest" times the kernels on random stand-ins of this many examples, never on the batch it is handed: with
# Poisson sampling a physical batch's size can be secret, and the choice is public (result.json records it).
TIMING_EXAMPLES = 256
TIMING_REPEATS = 3

_method: ContextVar[str] = ContextVar("filter_gradient_method", default="auto")
_timing_examples: ContextVar[int] = ContextVar("filter_gradient_timing_examples", default=TIMING_EXAMPLES)
_fastest: dict[tuple, str] = {}  # (device, dtype, shapes without the batch, geometry) -> the faster kernel's name


@contextlib.contextmanager
def filter_gradient_method(method: str, *, timing_examples: int = TIMING_EXAMPLES) -> Iterator[None]:
    """Inside the block, per-example filter gradients use `method` (one of FILTER_GRADIENT_METHODS).

    timing_examples: the public batch size "fastest" times its kernels at (DPTrainer: its physical batch).
    """
    if method not in FILTER_GRADIENT_METHODS:
        raise ParameterError(f"filter gradient method must be one of {FILTER_GRADIENT_METHODS}, got {method!r}")
    if isinstance(timing_examples, bool) or not isinstance(timing_examples, int) or timing_examples < 1:
        raise ParameterError(f"timing_examples must be a positive int, got {timing_examples!r}")
    tokens = _method.set(method), _timing_examples.set(timing_examples)
    try:
        yield
    finally:
        _timing_examples.reset(tokens[1])
        _method.reset(tokens[0])


def fastest_choices() -> dict[str, str]:
    """What "fastest" chose so far, by layer (for benchmark reports)."""

    def describe(device: str, dtype: str, inputs: tuple, outputs: tuple, views: int, g: ConvGeometry) -> str:
        return (
            f"{device} {dtype.removeprefix('torch.')} {inputs} -> {outputs} x{views} views, kernel {g.kernel} "
            f"stride {g.stride} padding {g.padding} dilation {g.dilation} groups {g.groups}"
        )

    return {describe(*key): name for key, name in _fastest.items()}


def times_kernels(device: torch.device) -> bool:
    """Whether the method in force times the kernels on `device` (at the first batch of each new layer shape)."""
    return _method_on(device) == "fastest"


def _method_on(device: torch.device) -> str:
    method = _method.get()
    if method == "auto":
        return "fastest" if device.type == "cuda" else "grouped"
    return method


def _kernel_for(inputs: torch.Tensor, grad_out: torch.Tensor, views: int, geometry: ConvGeometry) -> str:
    method = _method_on(inputs.device)
    if inputs.shape[0] == 0:  # no examples: a convolution with zero groups does not exist
        return "products"
    if method != "fastest":
        return method
    # keyed without the batch size: Poisson batches give every last chunk of a step its own size
    key = (str(inputs.device), str(grad_out.dtype), tuple(inputs.shape[1:]), tuple(grad_out.shape[1:]), views, geometry)
    if key not in _fastest:
        rows = _timing_examples.get() * views
        stand_ins = _stand_in(inputs, rows), _stand_in(grad_out, rows)
        timings = {
            name: _seconds(kernel, *stand_ins, views, geometry)
            for name, kernel in KERNELS.items()
            if RUNS_ON.get(name, _anywhere)(*stand_ins)
        }
        _fastest[key] = min(timings, key=timings.__getitem__)
    return _fastest[key]


def _stand_in(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """Random values of `rows` rows in tensor's dtype, device and memory layout, independent of its values and batch
    size (a generator of its own, so no global RNG moves)."""
    generator = torch.Generator(device=tensor.device).manual_seed(0)
    values = torch.randn((rows, *tensor.shape[1:]), generator=generator, device=tensor.device, dtype=tensor.dtype)
    channels_last = (
        tensor.dim() == 4 and not tensor.is_contiguous() and tensor.is_contiguous(memory_format=torch.channels_last)
    )
    return values.contiguous(memory_format=torch.channels_last) if channels_last else values


def _anywhere(inputs: torch.Tensor, grad_out: torch.Tensor) -> bool:
    return True


def _seconds(
    kernel: FilterGradientKernel, inputs: torch.Tensor, grad_out: torch.Tensor, views: int, geometry: ConvGeometry
) -> float:
    """Best of TIMING_REPEATS runs after a warm-up (which also lets cuDNN pick its algorithm).

    A kernel that fails on this shape (no cuDNN algorithm, not enough memory for its
    workspace, a Triton kernel that cannot be built or launched on this card) is infinitely
    slow: it is not chosen, and the run goes on with the others.
    """
    best = float("inf")
    try:
        for attempt in range(TIMING_REPEATS + 1):
            _synchronize(inputs.device)
            start = time.perf_counter()
            kernel(inputs, grad_out, views, geometry)
            _synchronize(inputs.device)
            if attempt:
                best = min(best, time.perf_counter() - start)
    except (RuntimeError, *KERNEL_FAILURES):  # torch.OutOfMemoryError is a RuntimeError
        return float("inf")
    return best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def steerable_weight_gradients(module: SteerableConv2d, filters: torch.Tensor) -> torch.Tensor:
    """Per-example gradients of module.weight from those of its expanded filter (B, C_out, C_in/groups, k, k).

    The transpose of SteerableConv2d.expand_filter: the basis contraction, then the
    vector-Jacobian product of the weight standardization when the layer has it
    (SteerableConv2d.weight_gradients).
    The contraction runs in the filters' dtype (bf16 ones, from autocast, are not copied
    to fp32 first: the filter gradient is this step's largest tensor); the result, and
    the standardization's product, are in the weight's dtype.
    Returns (B, out_fields, in_fields/groups, num_basis).
    """
    batch, k = filters.shape[0], module.kernel_size
    blocks = filters.reshape(batch, module.out_fields, module.out_size, -1, module.in_size, k, k)
    coefficients = torch.einsum("bxsyijk,nsijk->bxyn", blocks, module.basis.to(filters.dtype))
    return module.weight_gradients(coefficients.to(module.weight.dtype))


ALIGNMENT = 8  # elements: 16 bytes in bf16, the alignment cuBLAS's widest tensor-core kernels ask of every operand


def _aligned(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class _Grid:
    """Each example's views, padded, one after another in rows of an aligned width (`row` elements)."""

    padded_h: int
    row: int
    length: int  # views * padded_h * row (a multiple of ALIGNMENT): the positions a product runs over


def _laid_out_inputs(
    inputs: torch.Tensor, views: int, dtype: torch.dtype, kernel: tuple[int, int], padding: tuple[int, int]
) -> tuple[torch.Tensor, _Grid]:
    """(B, C_in, room) zeros holding the padded input in the grid, cast to `dtype` as it is placed.

    A zero tail of (kh - 1) rows and kw - 1 elements keeps every tap's shifted read inside the buffer.
    """
    (kh, kw), (ph, pw) = kernel, padding
    total, channels_in, height, width = inputs.shape
    batch, padded_h = total // views, height + 2 * ph
    row = _aligned(width + 2 * pw)
    grid = _Grid(padded_h, row, views * padded_h * row)
    flat = inputs.new_zeros(batch, channels_in, _aligned(grid.length + (kh - 1) * row + kw - 1), dtype=dtype)
    flat[:, :, : grid.length].view(batch, channels_in, views, padded_h, row)[
        :, :, :, ph : ph + height, pw : pw + width
    ] = inputs.reshape(batch, views, channels_in, height, width).transpose(1, 2)
    return flat, grid


def _placed_gradient(
    grad_out: torch.Tensor, views: int, grid: _Grid, dx: int, placed: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, C_out, grid.length): the output gradient in the grid, at columns dx.. of each row, zeros elsewhere.

    `placed`, the result of the same call at dx - 1, is moved one column on in place (its stale column zeroed):
    the buffer is zero-filled once per layer, not once per column shift (zeroing only the margins instead, in
    strided fills, is slower on an H200).
    """
    channels_out, out_h, out_w = grad_out.shape[1:]
    batch = grad_out.shape[0] // views
    if placed is None:
        grid_view = grad_out.new_zeros(batch, channels_out, views, grid.padded_h, grid.row)
    else:
        grid_view = placed.view(batch, channels_out, views, grid.padded_h, grid.row)
        grid_view[:, :, :, :out_h, dx - 1].zero_()
    grid_view[:, :, :, :out_h, dx : dx + out_w] = grad_out.reshape(batch, views, channels_out, out_h, out_w).transpose(
        1, 2
    )
    return grid_view.view(batch, channels_out, grid.length)


def _shifted_inputs(flat_inputs: torch.Tensor, dx: int, reach: int, shifted: torch.Tensor | None) -> torch.Tensor:
    """The laid-out input read dx elements on, copied to an aligned buffer (`shifted`, reused when given).

    Only the first `reach` elements of each row of the result are ever read (the last tap's shifted read).
    """
    if shifted is None:
        shifted = flat_inputs.new_empty(*flat_inputs.shape[:2], _aligned(reach))
    shifted[..., :reach].copy_(flat_inputs[..., dx : dx + reach])
    return shifted


def _column_shifts(
    flat_inputs: torch.Tensor, grad_out: torch.Tensor, views: int, grid: _Grid, kernel: tuple[int, int]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """For dx = 0 .. kw-1, (gradient, input) in the grid whose product at row offset dy * row is tap (dy, dx).

    The operand with fewer channels is the one copied per shift: the input, read dx elements on and
    copied flat, or the gradient, placed at columns dx.. (for the paper's convs, 3 -> 48 or 48 -> 104
    channels at 32x32, copying the input moves a fraction of the bytes).
    """
    kh, kw = kernel
    if flat_inputs.shape[1] < grad_out.shape[1]:
        placed = _placed_gradient(grad_out, views, grid, 0)
        yield placed, flat_inputs
        reach = grid.length + (kh - 1) * grid.row  # what the last row shift reads of each input row
        shifted = None
        for dx in range(1, kw):
            shifted = _shifted_inputs(flat_inputs, dx, reach, shifted)
            yield placed, shifted
    else:
        placed = None
        for dx in range(kw):
            placed = _placed_gradient(grad_out, views, grid, dx, placed)
            yield placed, flat_inputs


def _shifted_products(
    inputs: torch.Tensor, grad_out: torch.Tensor, views: int, kernel: tuple[int, int], padding: tuple[int, int]
) -> torch.Tensor:
    """The stride-1 case without unfolding: one batched product per filter tap.

    The padded input is laid out per example over (views, rows, columns) in rows of an
    aligned width, and the output gradient is placed in the same grid. Filter tap (dy, dx)
    pairs the gradient at column c with the input dx columns and dy rows further on: one `bmm`
    per tap, no k*k-fold copy of the input, and every operand pointer and leading dimension a
    multiple of ALIGNMENT (reading the input dx elements on in place made cuBLAS pick its 1- and
    2-element-aligned kernels), so _column_shifts copies one
    operand per column shift. Positions the row shift carries past a view meet zeros of the
    placed gradient, and a zero tail keeps the last shift inside the buffer. The input is cast
    to the gradient's dtype as it is laid out.
    """
    kh, kw = kernel
    batch, channels_in, channels_out = inputs.shape[0] // views, inputs.shape[1], grad_out.shape[1]
    flat_inputs, grid = _laid_out_inputs(inputs, views, grad_out.dtype, kernel, padding)
    # Taps are written in place into (B, C_out, taps, C_in padded to ALIGNMENT): each tap's (C_out, C_in) block is a
    # matrix with an aligned leading dimension, which cuBLAS writes directly (stacking taps last would copy everything).
    padded_in = _aligned(channels_in)
    by_tap = grad_out.new_empty(batch, channels_out, kh * kw, padded_in)
    with matmuls_in_convolution_precision(inputs.is_cuda):
        for dx, (placed, shifted) in enumerate(_column_shifts(flat_inputs, grad_out, views, grid, kernel)):
            size, strides = (batch, grid.length, channels_in), (shifted.stride(0), 1, shifted.stride(1))
            for dy in range(kh):
                torch.bmm(
                    placed,
                    shifted.as_strided(size, strides, dy * grid.row),
                    out=by_tap[:, :, dy * kw + dx, :channels_in],
                )
    return by_tap[..., :channels_in].unflatten(2, (kh, kw)).permute(0, 1, 4, 2, 3)


UNFOLD_SLICE_BYTES = 1 << 29  # the stacked input of at most this many bytes at a time (a slice of the examples)


def _unfolded_products(
    inputs: torch.Tensor, grad_out: torch.Tensor, views: int, kernel: tuple[int, int], padding: tuple[int, int]
) -> torch.Tensor:
    """The stride-1 case as one wide product: every tap's input stacked, the gradient placed once.

    In _shifted_products' grid, tap (dy, dx) pairs the gradient placed at column 0 with the
    input read dy rows and dx columns further on; copying those k*k shifted reads into rows
    (tap, C_in) of one aligned matrix turns the k*k narrow products (C_out x C_in each) into
    one of C_out x k*k*C_in per example, which keeps the tensor cores busier and reads the
    output gradient once. The stacked copy is made for a slice of the examples at a time
    (UNFOLD_SLICE_BYTES), into one buffer.
    """
    kh, kw = kernel
    batch, channels_in, channels_out = inputs.shape[0] // views, inputs.shape[1], grad_out.shape[1]
    flat_inputs, grid = _laid_out_inputs(inputs, views, grad_out.dtype, kernel, padding)
    placed = _placed_gradient(grad_out, views, grid, 0)
    stacked_rows = kh * kw * channels_in
    # every tap's shifted read of the input as one strided view: (B, kh, kw, C_in, positions of the grid)
    shifted = flat_inputs.as_strided(
        (batch, kh, kw, channels_in, grid.length), (flat_inputs.stride(0), grid.row, 1, flat_inputs.stride(1), 1)
    )
    per_example = _aligned(stacked_rows) * grid.length * flat_inputs.element_size()
    slice_size = max(1, min(batch, UNFOLD_SLICE_BYTES // per_example))
    stacked = flat_inputs.new_empty(slice_size, _aligned(stacked_rows), grid.length)
    stacked[:, stacked_rows:].zero_()  # alignment rows: their products are dropped, but must stay finite
    result = grad_out.new_empty(batch, channels_out, _aligned(stacked_rows))
    with matmuls_in_convolution_precision(inputs.is_cuda):
        for start in range(0, batch, slice_size):
            stop = min(batch, start + slice_size)
            rows = stacked[: stop - start]
            rows[:, :stacked_rows].unflatten(1, (kh, kw, channels_in)).copy_(shifted[start:stop])
            torch.bmm(placed[start:stop], rows.transpose(1, 2), out=result[start:stop])
    return result[..., :stacked_rows].unflatten(2, (kh, kw, channels_in)).permute(0, 1, 4, 2, 3)


@contextlib.contextmanager
def matmuls_in_convolution_precision(enabled: bool) -> Iterator[None]:
    """Run fp32 matmuls in TF32 inside the block when convolutions run in TF32 and matmuls in full fp32.

    The products here are a convolution's weight gradient, per example; cuDNN computes that
    gradient in TF32 unless `torch.backends.cudnn.allow_tf32` is off, while fp32 matmuls default to
    full precision (and run ~1.6x slower on an H100/H200). Only PyTorch's default state is
    changed, and restored on exit: if the user chose a matmul precision, or uses the per-backend
    `fp32_precision` settings (reading the legacy flags then raises), nothing is touched. The flag
    is process-wide, so matmuls of other threads inside the block run in TF32 too.
    """
    if not enabled:
        yield
        return
    try:
        switch = (
            torch.backends.cudnn.allow_tf32
            and not torch.backends.cuda.matmul.allow_tf32
            and torch.get_float32_matmul_precision() == "highest"
        )
    except RuntimeError:  # settings made through the per-backend API: leave them as they are
        switch = False
    if not switch:
        yield
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
