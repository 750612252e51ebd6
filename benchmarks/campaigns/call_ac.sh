#!/usr/bin/env bash
# GPU call AC (4 cards, session 11).
# Card 0's "after" tree was a working-tree variant that did not land: its FieldGroupNorm change (bf16 outputs) made the
# non-private step slower and was reverted (benchmarks/RESULTS.md, session 11); call AE measures the code that landed.
# Card 0: the DP step with FieldGroupNorm keeping bf16 activations in bf16 (fp32 statistics) and the stride-1 filter
# gradients copying, per column shift, whichever operand has fewer channels, against the code before (`.old` = commit
# 18cf3eb), alternating, one process per line; then Opacus hooks (fp32, the only precision they run in) next to the
# non-private and book-keeping steps, and the new code's kernel profile. Set-up, in the checkout:
#   rm -rf .old && mkdir .old && git archive 18cf3eb equiconvert benchmarks/throughput.py | tar x -C .old
# and carry .old with .gpul, .eqc and .data/fashion-mnist.
# Cards 1-3: call P's Fashion-MNIST recipe (D1, clip 0.1, lr 40, EMA 0.995; 89.84 / 89.81 / 89.44%) with crop shifts of
# at most 2 pixels instead of 4 (`--crop-padding 2`) on seeds 0-2: the 28x28 images sit in a 2-pixel zero border, so a
# 4-pixel reflection also mirrors 2 pixels of the garment into the view; 2 pixels only mirror the border.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40"
train 1 fmac_crop2_s0 $FM --crop-padding 2 --seed 0 --time-limit "$(left)"
train 2 fmac_crop2_s1 $FM --crop-padding 2 --seed 1 --time-limit "$(left)"
train 3 fmac_crop2_s2 $FM --crop-padding 2 --seed 2 --time-limit "$(left)"
export CUDA_VISIBLE_DEVICES=0
T="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 10 --methods nonprivate,bookkeeping:fastest"
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $RESULTS/throughput_bf16_before.json) 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $RESULTS/throughput_bf16_after.json 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $RESULTS/throughput_fp32_after.json 2>&1 | tail -1
(cd .old && timeout 100 python benchmarks/throughput.py $T --precision fp32 --out $RESULTS/throughput_fp32_before.json) 2>&1 | tail -1
timeout 100 python benchmarks/throughput.py $T --precision bf16 --out $RESULTS/throughput_bf16_after2.json 2>&1 | tail -1
timeout 150 python benchmarks/throughput.py --device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 5 \
    --methods nonprivate,bookkeeping:fastest,opacus --out $RESULTS/throughput_fp32_opacus.json 2>&1 | tail -1
timeout 60 python benchmarks/profile_step.py --device cuda --model paper --batch 512 --aug-mult 4 --precision bf16 \
    --cudnn-benchmark --filter-gradients fastest --top 60 --out $RESULTS/profile_paper_d4_512x4_bf16_top60_after.json 2>&1 | tail -1
unset CUDA_VISIBLE_DEVICES
wait
pack_each "fmac_*"
