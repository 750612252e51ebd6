#!/usr/bin/env bash
# GPU call AD (4 cards, session 11).
# Card 0's "after" tree was a working-tree variant that did not land: its FieldGroupNorm change (bf16 outputs) made the
# non-private step slower and was reverted (benchmarks/RESULTS.md, session 11); call AE measures the code that landed.
# Card 0: the DP step with FieldGroupNorm returning bf16 activations in bf16 (fp32 statistics and arithmetic, one
# dtype per kernel), stride-1 filter gradients copying, per column shift, whichever operand has fewer channels, grid
# buffers zeroed only around what is placed, conv bias sums accumulated in fp32 without an fp32 copy; against the code
# before this session (`.old` = commit 18cf3eb), alternating, one process per line; Opacus hooks (fp32, the only
# precision they run in) next to the non-private and book-keeping steps, new and old code; the new code's profile.
# Set-up, in the checkout:
#   rm -rf .old && mkdir .old && git archive 18cf3eb equiconvert benchmarks/throughput.py | tar x -C .old
# and carry .old with .gpul, .eqc and .data/fashion-mnist. The benchmark JSONs come back in one archive, bench.tgz.
# Cards 1-3: call P's Fashion-MNIST recipe (D1, clip 0.1, lr 40, EMA 0.995; 89.84 / 89.81 / 89.44%) with the inputs
# standardized by Fashion-MNIST's mean and std (0.286, 0.353) instead of 0.5, 0.5, on seeds 0-2.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40"
train 1 fmad_norm_s0 $FM --normalize 0.286,0.353 --seed 0 --time-limit "$(left)"
train 2 fmad_norm_s1 $FM --normalize 0.286,0.353 --seed 1 --time-limit "$(left)"
train 3 fmad_norm_s2 $FM --normalize 0.286,0.353 --seed 2 --time-limit "$(left)"
export CUDA_VISIBLE_DEVICES=0
B="$RESULTS/bench"; mkdir -p "$B"
T="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 10 --methods nonprivate,bookkeeping:fastest"
O="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 5 --methods nonprivate,bookkeeping:fastest,opacus"
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/throughput_bf16_before.json) 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/throughput_bf16_after.json 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $B/throughput_fp32_after.json 2>&1 | tail -1
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $B/throughput_fp32_before.json) 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $B/throughput_bf16_after2.json 2>&1 | tail -1
timeout 60 python benchmarks/profile_step.py --device cuda --model paper --batch 512 --aug-mult 4 --precision bf16 \
    --cudnn-benchmark --filter-gradients fastest --top 60 --out $B/profile_paper_d4_512x4_bf16_top60_after.json 2>&1 | tail -1
timeout 120 python benchmarks/throughput.py $O --out $B/throughput_fp32_opacus_after.json 2>&1 | tail -1
(cd .old && timeout 120 python benchmarks/throughput.py $O --out $B/throughput_fp32_opacus_before.json) 2>&1 | tail -1
unset CUDA_VISIBLE_DEVICES
tar czf "$RESULTS/bench.tgz" -C "$RESULTS" bench && rm -rf "$B"
wait
pack_each "fmad_*"
