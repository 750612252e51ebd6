#!/usr/bin/env bash
# GPU call T (2 cards, session 8).
# Card 0: book-keeping after its steerable basis contraction moved to the filters' own dtype (bf16 under autocast,
# no fp32 copy of the per-example filter gradients), paper D4 model, 512 x 4, bf16, cuDNN autotuning: products vs
# fastest vs non-private in one process; the step's profile (forward, backward, per-example, other). Then call S's two
# unconverted runs on call P's recipe (clip 0.1, lr 40), resumed from their step-3,580 checkpoints (carry .runs).
# Card 1: the unconverted network on that recipe, seed 2.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-330}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group none --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40"
train 1 fms_none_s2 $FM --seed 2 --time-limit "$(left)"
CUDA_VISIBLE_DEVICES=0 python benchmarks/throughput.py --device cuda --model paper --batch 512 --aug-mult 4 \
    --methods nonprivate,bookkeeping:products,bookkeeping:fastest --precision bf16 --cudnn-benchmark --iters 10 \
    --out "$RESULTS/throughput_paper_d4_512x4_bf16_kernels.json" 2>&1 | grep -v Warning | tail -4
CUDA_VISIBLE_DEVICES=0 python benchmarks/profile_step.py --device cuda --model paper --batch 512 --aug-mult 4 \
    --precision bf16 --cudnn-benchmark --filter-gradients fastest --top 12 \
    --out "$RESULTS/profile_paper_d4_512x4_bf16.json" 2>&1 | grep -v -i "warn\|USDT\|ERROR:" | head -40
for seed in 0 1; do train 0 fms_none_s$seed $FM --seed $seed --time-limit "$(left)"; wait $!; done
wait
pack_each "fms_none_*"
