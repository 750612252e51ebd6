#!/usr/bin/env bash
# GPU call AH (one H200, session 12): the uneven FieldGroupNorm on Triton kernels (equiconvert/nn/fused_norm.py: bf16
# activations read as they are, one vectorized pass each for statistics, output, gradient sums and input gradient)
# against `.old` (commit dec6b0c, before this session) and `.var` (this tree with the kernels writing the input's
# dtype, bf16 under autocast, instead of fp32), alternating, one process per line; the compiled kernels checked
# against the torch path on the card first; then the profile and Opacus hooks (fp32). Set-up, in the checkout:
#   rm -rf .old && mkdir .old && git archive dec6b0c equiconvert benchmarks/throughput.py | tar x -C .old
#   (.var: a copy of equiconvert/ and benchmarks/ with row_affine's output `torch.empty_like(rows)`)
# and carry .old, .var with .gpul and .eqc. The JSONs come back in one archive, bench.tgz.
source benchmarks/campaigns/common.sh
B="$RESULTS/bench"; mkdir -p "$B"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$B/gpus.csv"
python - > "$B/cuda_check.txt" 2>&1 <<'PY'
import torch, triton
from equiconvert.nn import FieldGroupNorm
from equiconvert.nn import fused_norm
print("torch", torch.__version__, "triton", triton.__version__)
g = torch.Generator(device="cuda").manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for fields, size in ((13, 32), (39, 16), (39, 4)):
        x = (3 + 2 * torch.randn(64, fields * 8, size, size, device="cuda", generator=g)).to(dtype)
        up = torch.randn(x.shape, device="cuda", generator=g)
        norm = FieldGroupNorm(fields, 8, 8, affine=False).cuda()
        outs = []
        for path in ("fused", "torch64"):
            inp = (x if path == "fused" else x.double()).clone().requires_grad_(True)
            out = norm.double()(inp) if path == "torch64" else norm.float()(inp)
            grad, = torch.autograd.grad((out * up.to(out.dtype)).sum(), inp)
            outs.append((out.double(), grad.double(), type(out.grad_fn).__name__, grad.dtype))
        (o1, g1, n1, d1), (o2, g2, _, _) = outs
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()
        print(dtype, fields, size, n1, d1, "out rel", rel(o1, o2), "grad rel", rel(g1, g2))
PY
cat "$B/cuda_check.txt"
T="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 10 --methods nonprivate,bookkeeping:fastest"
for round in 1 2; do
    (cd .old && timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_before_$round.json) 2>&1 | tail -1
    timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_after_$round.json 2>&1 | tail -1
    (cd .var && timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_bf16out_$round.json) 2>&1 | tail -1
done
timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $B/fp32_after.json 2>&1 | tail -1
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $B/fp32_before.json) 2>&1 | tail -1
timeout 60 python benchmarks/profile_step.py --device cuda --model paper --batch 512 --aug-mult 4 --precision bf16 \
    --cudnn-benchmark --filter-gradients fastest --top 60 --out $B/profile_paper_d4_512x4_bf16_top60_after.json 2>&1 | tail -1
timeout 120 python benchmarks/throughput.py --device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 5 \
    --methods nonprivate,bookkeeping:fastest,opacus --out $B/fp32_opacus_after.json 2>&1 | tail -1
tar czf "$RESULTS/bench.tgz" -C "$RESULTS" bench && rm -rf "$B"
