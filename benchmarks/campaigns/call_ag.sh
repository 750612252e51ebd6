#!/usr/bin/env bash
# GPU call AG (one H200, session 11): FieldGroupNorm's backward without forming y again (sum of dy * y and dx expanded
# in x: one full-size pass fewer) and conv bias sums over each view's positions first; this tree against `.mid`
# (commit a65e506, the code call AF measured) and `.old` (commit 18cf3eb, before this session), alternating, one
# process per line; Opacus hooks next to the non-private and book-keeping steps (fp32, Opacus' only precision); then
# the kernel profile. Set-up, in the checkout:
#   for c in old:18cf3eb mid:a65e506; do rm -rf .${c%%:*} && mkdir .${c%%:*} &&
#       git archive ${c#*:} equiconvert benchmarks/throughput.py | tar x -C .${c%%:*}; done
# and carry .old, .mid with .gpul and .eqc. The JSONs come back in one archive, bench.tgz.
source benchmarks/campaigns/common.sh
B="$RESULTS/bench"; mkdir -p "$B"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$B/gpus.csv"
T="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 10 --methods nonprivate,bookkeeping:fastest"
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_before_1.json) 2>&1 | tail -1
(cd .mid && timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_call_af_1.json) 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_after_1.json 2>&1 | tail -1
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_before_2.json) 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_after_2.json 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $B/fp32_after.json 2>&1 | tail -1
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $B/fp32_before.json) 2>&1 | tail -1
timeout 60 python benchmarks/profile_step.py --device cuda --model paper --batch 512 --aug-mult 4 --precision bf16 \
    --cudnn-benchmark --filter-gradients fastest --top 60 --out $B/profile_paper_d4_512x4_bf16_top60_after.json 2>&1 | tail -1
timeout 120 python benchmarks/throughput.py --device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 5 \
    --methods nonprivate,bookkeeping:fastest,opacus --out $B/fp32_opacus_after.json 2>&1 | tail -1
tar czf "$RESULTS/bench.tgz" -C "$RESULTS" bench && rm -rf "$B"
