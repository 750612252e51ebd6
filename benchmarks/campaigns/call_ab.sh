#!/usr/bin/env bash
# GPU call AB (one H200, session 10): FieldGroupNorm's uneven-groups path with a hand-written backward (nine of the
# paper D4 model's ten norms take it) against the code before it (`.old` = commit b26ff8e), alternating, in one
# process per line on the same card: the non-private step and the DP step ("fastest"), bf16 and fp32; then the new
# code's profile by kernel. Set-up, in the checkout:
#   rm -rf .old && mkdir .old && git archive b26ff8e equiconvert benchmarks/throughput.py | tar x -C .old
# and carry .old with .gpul and .eqc.
source benchmarks/campaigns/common.sh
T="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 10 --methods nonprivate,bookkeeping:fastest"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$RESULTS/gpus.csv"
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $RESULTS/throughput_bf16_before.json) 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $RESULTS/throughput_bf16_after.json 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $RESULTS/throughput_fp32_after.json 2>&1 | tail -1
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $RESULTS/throughput_fp32_before.json) 2>&1 | tail -1
timeout 60 python benchmarks/profile_step.py --device cuda --model paper --batch 512 --aug-mult 4 --precision bf16 \
    --cudnn-benchmark --filter-gradients fastest --top 60 --out $RESULTS/profile_paper_d4_512x4_bf16_top60_after.json 2>&1 | tail -1
