#!/usr/bin/env bash
# GPU call R (2 cards, session 8).
# Card 0: issue 4's open measurement on the paper's D4 model, 512 x 4, cuDNN autotuning: book-keeping with the
# batched-products kernel vs 'fastest' (per layer shape the faster of products and cuDNN's grouped weight gradient),
# bf16 and fp32, in one process each; the per-layer kernel timings; a profile of where the DP step's time goes.
# Then a wider D1 (--width 3: 405k parameters instead of 200k) on call P's Fashion-MNIST recipe (clip 0.1, lr 40), seed 0.
# Card 1: call Q's two stopped seeds of that recipe, resumed side by side on one card; then the wider D1, seed 1.
source benchmarks/campaigns/common.sh
restore benchmarks/results/campaign/call_q fmq_clip0.1_lr40_s1 fmq_clip0.1_lr40_s2
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40"
(
    train 1 fmq_clip0.1_lr40_s1 $FM --seed 1 --time-limit "$(left)"
    train 1 fmq_clip0.1_lr40_s2 $FM --seed 2 --time-limit "$(left)"
    wait
    train 1 fmr_width3_s1 $FM --width 3 --seed 1 --time-limit "$(left)"
    wait
) &
for precision in bf16 fp32; do
    CUDA_VISIBLE_DEVICES=0 python benchmarks/throughput.py --device cuda --model paper --batch 512 --aug-mult 4 \
        --methods nonprivate,bookkeeping:products,bookkeeping:fastest --precision $precision --cudnn-benchmark --iters 10 \
        --out "$RESULTS/throughput_paper_d4_512x4_${precision}_kernels.json" 2>&1 | grep -v Warning | tail -5
done
CUDA_VISIBLE_DEVICES=0 python benchmarks/filter_gradients.py --device cuda --batch 512 --aug-mult 4 \
    --out "$RESULTS/filter_gradients.json" 2>&1 | tail -12
CUDA_VISIBLE_DEVICES=0 python benchmarks/profile_step.py --device cuda --model paper --batch 512 --aug-mult 4 \
    --precision bf16 --cudnn-benchmark --filter-gradients fastest --out "$RESULTS/profile_paper_d4_512x4_bf16.json" 2>&1 | grep -v -i "warn\|USDT\|ERROR:" | head -80
train 0 fmr_width3_s0 $FM --width 3 --seed 0 --time-limit "$(left)"
wait
pack_each "fm[qr]_*"
