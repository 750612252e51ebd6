#!/usr/bin/env bash
# GPU call AE (one H200, session 11): the code this session lands (stride-1 filter gradients copying, per column shift,
# whichever operand has fewer channels; the placed gradient zero-filled once per layer; conv bias sums accumulated in
# fp32 without an fp32 copy) against the code before it (`.old` = commit 18cf3eb) and against the same code with the
# gradient always the operand copied per shift (`.alt`), alternating, one process per line; then its kernel profile.
# Set-up, in the checkout:
#   rm -rf .old && mkdir .old && git archive 18cf3eb equiconvert benchmarks/throughput.py | tar x -C .old
#   .alt: a copy of equiconvert/ and benchmarks/throughput.py with `if flat_inputs.shape[1] < grad_out.shape[1]:` in
#   _column_shifts replaced by `if False:`
# and carry .old, .alt with .gpul and .eqc. The JSONs come back in one archive, bench.tgz.
source benchmarks/campaigns/common.sh
B="$RESULTS/bench"; mkdir -p "$B"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$B/gpus.csv"
T="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 10 --methods nonprivate,bookkeeping:fastest"
for round in 1 2; do
    (cd .old && timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_before_$round.json) 2>&1 | tail -1
    timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_after_$round.json 2>&1 | tail -1
    (cd .alt && timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/bf16_gradient_shifted_$round.json) 2>&1 | tail -1
done
timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $B/fp32_after.json 2>&1 | tail -1
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $B/fp32_before.json) 2>&1 | tail -1
timeout 60 python benchmarks/profile_step.py --device cuda --model paper --batch 512 --aug-mult 4 --precision bf16 \
    --cudnn-benchmark --filter-gradients fastest --top 60 --out $B/profile_paper_d4_512x4_bf16_top60_after.json 2>&1 | tail -1
tar czf "$RESULTS/bench.tgz" -C "$RESULTS" bench && rm -rf "$B"
