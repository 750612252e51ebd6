#!/usr/bin/env bash
# GPU call N (4 cards, session 6): bf16 autocast (DPTrainer precision="bf16", `--precision bf16`).
# Card 0: benchmarks/throughput.py on the paper's D4 model, 512 x 4, non-private vs book-keeping, fp32 and bf16, each
# with and without cuDNN's per-shape algorithm search. Cards 1-2: Fashion-MNIST eps=3 with call J/K's schedule
# (D1, K=2, batch 2048, 4000 steps, lr 2 cosine, EMA 0.995, PRV) in bf16, seeds 0 and 1 (fp32: 89.85 / 90.09%,
# evaluated every 500 steps as those). Card 3: call M's unconverted seed 2, resumed from its checkpoint.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-420}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --max-grad-norm 2 --physical-batch-size 2304 --eval-every 500 --checkpoint-every 50 --lr 2 --lr-schedule cosine --ema-decay 0.995 --aug-mult 2 --batch-size 2048"
train 1 fmn_D1_bf16_s0 $FM --group D1 --steps 4000 --precision bf16 --seed 0 --time-limit "$(left)"
train 2 fmn_D1_bf16_s1 $FM --group D1 --steps 4000 --precision bf16 --seed 1 --time-limit "$(left)"
train 3 fmm_none_s2 $FM --group none --steps 7500 --seed 2 --time-limit "$(left)"
for precision in fp32 bf16; do
    for bench in "" "--cudnn-benchmark"; do
        CUDA_VISIBLE_DEVICES=0 python benchmarks/throughput.py --device cuda --model paper --batch 512 --aug-mult 4 \
            --methods nonprivate,bookkeeping --precision $precision $bench --iters 10 \
            --out "$RESULTS/throughput_paper_d4_512x4_${precision}${bench:+_cudnn_benchmark}.json" 2>&1 | tail -3
    done
done
wait
pack_each "fmn_*"
pack_each "fmm_none_s2"
