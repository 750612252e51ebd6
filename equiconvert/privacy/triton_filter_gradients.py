"""Per-example conv filter gradients as a Triton kernel: an implicit GEMM per example, no copy of the patches.

The kernel sums output gradient x input patch over each example's views and output positions, reading
the patches straight from the input by index arithmetic (zero outside the padded border), so nothing
of the k*k-fold unfolded input is ever written and each example's input stays in the cache. It tiles
the filter gradient two ways, and which is faster depends on the layer (filter_gradients.py times both):

- "patch columns": a program computes (output channels x (input channel, tap)) of one example; its
  columns mix taps, so a layer with few input channels (an RGB stem: 3 x 9 columns) fills its tiles.
- "one tap" (ONE_TAP): a program computes (output channels x input channels) of one tap of one example;
  its addresses are a position part plus a channel part, so wide inputs cost little index arithmetic. It
  writes the gradient tap-major, (B, kh, kw, C_out, C_in), so that a tile's stores are contiguous, and
  returns it as a permuted view.

On CUDA, Triton's autotuner picks the tile sizes once per layer shape; the matmuls run in the precision
of the convolutions (bf16 as given, fp32 in TF32 when cuDNN uses TF32). Off CUDA the tests run the same
kernel in Triton's interpreter and build it for sm_90 with Triton's compiler. Ungrouped convs of any
stride, padding and dilation; filter_gradients.py routes grouped ones to its batched products.
"""

from __future__ import annotations

import torch

from ..errors import ParameterError

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton ships with PyTorch's CUDA wheels on Linux; elsewhere the other kernels run
    triton = None

# errors of a kernel that cannot be built or launched for a shape on this card: "fastest" then skips it
KERNEL_FAILURES: tuple[type[Exception], ...] = ()
if triton is not None:
    try:
        from triton.errors import TritonError

        KERNEL_FAILURES = (TritonError,)
    except ImportError:  # an older Triton, whose compile and resource errors have no common base
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources

        KERNEL_FAILURES = (CompilationError, OutOfResources)

KERNEL_DEVICES = ("cuda",)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # tensor-core dtypes; float64 has no tl.dot
INTERPRETED_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_R": 32}  # off CUDA: one fixed tile, no timing


def triton_kernel_usable(inputs: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """Whether the kernel can run on these tensors: Triton present, a kernel device, 16- or 32-bit floats."""
    return (
        triton is not None
        and inputs.device.type in KERNEL_DEVICES
        and inputs.dtype in KERNEL_DTYPES
        and grad_out.dtype in KERNEL_DTYPES
    )


if triton is not None:

    @triton.jit
    def _per_example_filter_gradient_kernel(
        x_ptr,
        g_ptr,
        out_ptr,
        c_out,
        c_in,
        in_h,
        in_w,
        out_h,
        out_w,
        views,
        x_sn,
        x_sc,
        x_sh,
        x_sw,
        g_sn,
        g_sc,
        g_sh,
        g_sw,
        stride_h,
        stride_w,
        pad_h,
        pad_w,
        dil_h,
        dil_w,
        KH: tl.constexpr,
        KW: tl.constexpr,
        ONE_TAP: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        # ONE_TAP: a program's columns are input channels of one tap; else (input channel, tap) pairs
        tiles_m = tl.cdiv(c_out, BLOCK_M)
        if ONE_TAP:
            tiles_n = tl.cdiv(c_in, BLOCK_N)
            per_example = tiles_m * tiles_n * KH * KW
        else:
            columns_total = c_in * KH * KW
            tiles_n = tl.cdiv(columns_total, BLOCK_N)
            per_example = tiles_m * tiles_n
        pid = tl.program_id(0)
        example = (pid // per_example).to(tl.int64)  # examples outermost: one example's tiles run together
        tile = pid % per_example
        if ONE_TAP:
            tap = tile // (tiles_m * tiles_n)
            tile = tile % (tiles_m * tiles_n)
        rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)  # output channels
        columns = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        if ONE_TAP:
            offset_y = (tap // KW) * dil_h - pad_h
            offset_x = (tap % KW) * dil_w - pad_w
        else:
            channel = columns // (KH * KW)
            tap_y = (columns % (KH * KW)) // KW
            tap_x = columns % KW
        positions = out_h * out_w
        reduction = views * positions
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, reduction, BLOCK_R):
            r = start + tl.arange(0, BLOCK_R)  # (view, output row, output column)
            image = example * views + r // positions
            y = (r % positions) // out_w
            x = r % out_w
            if ONE_TAP:  # addresses: a position part plus a channel part
                g_tile = tl.load(
                    g_ptr + (image * g_sn + y * g_sh + x * g_sw)[None, :] + rows[:, None] * g_sc,
                    mask=(rows[:, None] < c_out) & (r[None, :] < reduction),
                    other=0.0,
                )
                iy = y * stride_h + offset_y
                ix = x * stride_w + offset_x
                inside = (r < reduction) & (iy >= 0) & (iy < in_h) & (ix >= 0) & (ix < in_w)
                x_tile = tl.load(
                    x_ptr + (image * x_sn + iy * x_sh + ix * x_sw)[:, None] + columns[None, :] * x_sc,
                    mask=inside[:, None] & (columns[None, :] < c_in),
                    other=0.0,
                )
            else:
                g_tile = tl.load(
                    g_ptr + image[None, :] * g_sn + rows[:, None] * g_sc + y[None, :] * g_sh + x[None, :] * g_sw,
                    mask=(rows[:, None] < c_out) & (r[None, :] < reduction),
                    other=0.0,
                )
                iy = y[:, None] * stride_h - pad_h + tap_y[None, :] * dil_h
                ix = x[:, None] * stride_w - pad_w + tap_x[None, :] * dil_w
                inside = (r[:, None] < reduction) & (columns[None, :] < columns_total)
                inside = inside & (iy >= 0) & (iy < in_h) & (ix >= 0) & (ix < in_w)
                x_tile = tl.load(
                    x_ptr + image[:, None] * x_sn + channel[None, :] * x_sc + iy * x_sh + ix * x_sw,
                    mask=inside,
                    other=0.0,
                )
            acc = tl.dot(g_tile, x_tile.to(g_tile.dtype), acc, input_precision=INPUT_PRECISION)
        if ONE_TAP:  # out is (B, KH*KW, C_out, C_in): a tile's columns are consecutive, so its stores coalesce
            written = (rows[:, None] < c_out) & (columns[None, :] < c_in)
            offsets = ((example * (KH * KW) + tap) * c_out + rows[:, None]) * c_in + columns[None, :]
        else:
            written = (rows[:, None] < c_out) & (columns[None, :] < columns_total)
            offsets = example * c_out * columns_total + rows[:, None] * columns_total + columns[None, :]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=written)

    _TUNED_TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_R, warps, stages)
        (64, 64, 32, 4, 3),
        (128, 64, 32, 4, 3),
        (64, 128, 32, 4, 3),
        (128, 128, 32, 8, 3),
        (32, 64, 64, 4, 4),
        (64, 64, 64, 4, 4),
        (32, 32, 64, 4, 4),
    ]

    _autotuned_kernel = triton.autotune(
        configs=[
            triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_R": r}, num_warps=warps, num_stages=stages)
            for m, n, r, warps, stages in _TUNED_TILES
        ],
        key=["c_out", "c_in", "out_h", "out_w", "views", "KH", "KW", "ONE_TAP"],
    )(_per_example_filter_gradient_kernel)


LAYOUTS = ("patch columns", "one tap")


def triton_filter_gradients(
    inputs: torch.Tensor,
    grad_out: torch.Tensor,
    views: int,
    *,
    layout: str,
    kernel: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> torch.Tensor:
    """(B, C_out, C_in, kh, kw) in grad_out's dtype (a permuted view for "one tap"): each example's filter
    gradient of an ungrouped conv.

    inputs (B*K, C_in, H, W) and grad_out (B*K, C_out, H', W') hold each example's K views consecutively,
    in any memory layout; inputs of another float dtype are cast inside the kernel. `layout` names the
    tiling ("patch columns" or "one tap").

    Raises:
        ParameterError: Triton is missing, or the tensors are not on a kernel device in a 16/32-bit float.
    """
    if not triton_kernel_usable(inputs, grad_out):
        raise ParameterError(
            f"the Triton filter-gradient kernels need Triton and {' or '.join(KERNEL_DEVICES)} tensors of "
            f"{', '.join(str(d).removeprefix('torch.') for d in KERNEL_DTYPES)}; got {inputs.device.type} "
            f"{str(inputs.dtype).removeprefix('torch.')} (Triton {'missing' if triton is None else 'present'}): "
            "use filter_gradients='auto'"
        )
    if layout not in LAYOUTS:
        raise ParameterError(f"Triton filter-gradient layout must be one of {LAYOUTS}, got {layout!r}")
    one_tap = layout == "one tap"
    batch, c_in, c_out, (kh, kw) = inputs.shape[0] // views, inputs.shape[1], grad_out.shape[1], kernel
    out = grad_out.new_empty(batch, kh, kw, c_out, c_in) if one_tap else grad_out.new_empty(batch, c_out, c_in, kh, kw)
    result = out.permute(0, 3, 4, 1, 2) if one_tap else out  # (B, C_out, C_in, kh, kw) either way
    if batch == 0:
        return result
    arguments = (
        inputs,
        grad_out,
        out,
        c_out,
        c_in,
        *inputs.shape[2:],
        *grad_out.shape[2:],
        views,
        *inputs.stride(),
        *grad_out.stride(),
        *stride,
        *padding,
        *dilation,
    )

    def grid(meta: dict) -> tuple[int]:
        if one_tap:
            per_example = triton.cdiv(c_out, meta["BLOCK_M"]) * triton.cdiv(c_in, meta["BLOCK_N"]) * kh * kw
        else:
            per_example = triton.cdiv(c_out, meta["BLOCK_M"]) * triton.cdiv(c_in * kh * kw, meta["BLOCK_N"])
        return (batch * per_example,)

    shape = {"KH": kh, "KW": kw, "ONE_TAP": one_tap}
    if inputs.device.type == "cuda":
        precision = "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"
        _autotuned_kernel[grid](*arguments, **shape, INPUT_PRECISION=precision)
    else:
        _per_example_filter_gradient_kernel[grid(INTERPRETED_BLOCKS)](
            *arguments, **shape, INPUT_PRECISION="ieee", **INTERPRETED_BLOCKS
        )
    return result
