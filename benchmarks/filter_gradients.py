"""Per-example conv filter gradients: book-keeping's kernel against the alternatives, layer by layer.

For B examples x K views of a 3x3, stride-1, padding-1 convolution of each shape, times:
  aggregate       cuDNN's ordinary weight gradient of the whole batch (the floor: no per-example split)
  unfold_einsum   unfold the input (k*k-fold copy), one einsum with the output gradient (book-keeping before)
  products        equiconvert's kernels (equiconvert/privacy/filter_gradients.py KERNELS), each forced:
  grouped           one bmm per filter tap; cuDNN's weight gradient of a grouped convolution with the
  unfolded          examples as groups; the taps stacked into one wide bmm per slice of examples;
  triton            the Triton implicit-GEMM kernels, tiled over (input channel, tap) columns or over one
  triton_taps       tap's input channels (CUDA only: listed under "not_run" elsewhere)
and the relative error of each per-example result against unfold_einsum, all matmuls in the precision
of the convolutions (TF32 on CUDA by default; --dtype bf16: the tensors in bf16, as under autocast),
so the error checks the layouts, not the precision. JSON.
Usage: python benchmarks/filter_gradients.py --device cuda --batch 512 --aug-mult 4 [--dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from equiconvert.privacy.filter_gradients import KERNELS as EQUICONVERT_KERNELS  # noqa: E402
from equiconvert.privacy.filter_gradients import RUNS_ON  # noqa: E402
from equiconvert.privacy.filter_gradients import filter_gradient_method, per_example_filter_gradients  # noqa: E402

# (C_in, C_out, size): the paper's D4 Equivariant-ResNet9 layers at 32x32 input (channels and feature-map size)
SHAPES = [(3, 48, 32), (48, 104, 32), (104, 104, 16), (104, 312, 16), (312, 156, 8), (156, 156, 4)]
Kernel = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def aggregate(x: torch.Tensor, g: torch.Tensor, views: int) -> torch.Tensor:
    weight = x.new_empty(g.shape[1], x.shape[1], 3, 3)
    return torch.ops.aten.convolution_backward(
        g, x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False]
    )[1]


def unfold_einsum(x: torch.Tensor, g: torch.Tensor, views: int) -> torch.Tensor:
    batch = x.shape[0] // views
    columns = F.unfold(x, 3, padding=1)
    columns = columns.reshape(batch, views, columns.shape[1], columns.shape[2])
    return torch.einsum("bkol,bkdl->bod", g.reshape(batch, views, g.shape[1], -1), columns)


def equiconvert_kernel(name: str) -> Kernel:
    def kernel(x: torch.Tensor, g: torch.Tensor, views: int) -> torch.Tensor:
        with filter_gradient_method(name):
            grads = per_example_filter_gradients(x, g, views, kernel=3, padding=1)
        return grads.reshape(x.shape[0] // views, g.shape[1], -1)

    return kernel


KERNELS: dict[str, Kernel] = {
    "aggregate": aggregate,
    "unfold_einsum": unfold_einsum,
    **{name: equiconvert_kernel(name) for name in EQUICONVERT_KERNELS},
}


def milliseconds(kernel: Kernel, x: torch.Tensor, g: torch.Tensor, views: int, iters: int) -> float:
    kernel(x, g, views)
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        kernel(x, g, views)
    if x.is_cuda:
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start) / iters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--aug-mult", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--out", default="benchmarks/results/filter_gradients.json")
    args = parser.parse_args(argv)
    device, views = torch.device(args.device), args.aug_mult
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32  # the reference in conv precision too
    rows, not_run = [], set()
    for channels_in, channels_out, size in SHAPES:
        x = torch.randn(args.batch * views, channels_in, size, size, device=device, dtype=dtype)
        g = torch.randn(args.batch * views, channels_out, size, size, device=device, dtype=dtype)
        reference = unfold_einsum(x, g, views).float()
        row: dict[str, float | int] = {"c_in": channels_in, "c_out": channels_out, "size": size}
        for name, kernel in KERNELS.items():
            if name in RUNS_ON and not RUNS_ON[name](x, g):
                not_run.add(name)
                continue
            row[f"{name}_ms"] = milliseconds(kernel, x, g, views, args.iters)
            if name not in ("aggregate", "unfold_einsum"):
                result = kernel(x, g, views).reshape(reference.shape).float()
                row[f"{name}_relative_error"] = float((result - reference).norm() / reference.norm())
        rows.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "command": " ".join(["python", "benchmarks/filter_gradients.py", *(argv or sys.argv[1:])]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "aug_mult": views,
        "dtype": args.dtype,
        "relative_error_reference": "unfold_einsum, matmuls in the precision given under tf32",
        "tf32": {"cudnn": torch.backends.cudnn.allow_tf32, "matmul": torch.backends.cuda.matmul.allow_tf32},
        "rows": rows,
        "not_run": sorted(not_run),  # kernels that cannot run on this device and dtype
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
