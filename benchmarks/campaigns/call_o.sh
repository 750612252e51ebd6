#!/usr/bin/env bash
# GPU call O (4 cards, session 7): one seed-0 run per card of call J/K's Fashion-MNIST schedule (D1, epsilon 3, PRV,
# batch 2048 x 2 views, 4000 steps, lr 2 cosine, clip 2, EMA 0.995, fp32, initial weights seeded), each changing one
# thing against the control on card 0, which shares its initial weights, sampling and noise streams with cards 1 and 3.
# Card 1: flip-invariant head (--head invariant: global pooling instead of the paper's 2x2 grid).
# Card 2: the same compute spent on twice the batch with one (unaugmented) view: batch 4096 x 1.
# Card 3: Fashion-MNIST's own mean/std input normalization (0.286, 0.353) instead of 0.5, 0.5.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --max-grad-norm 2 --eval-every 500 --checkpoint-every 50 --lr 2 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --seed 0"
train 0 fmo_control_s0 $FM --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --time-limit "$(left)"
train 1 fmo_invhead_s0 $FM --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --head invariant --time-limit "$(left)"
train 2 fmo_k1_b4096_s0 $FM --aug-mult 1 --batch-size 4096 --physical-batch-size 4608 --time-limit "$(left)"
train 3 fmo_norm_s0 $FM --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --normalize 0.286,0.353 --time-limit "$(left)"
wait
pack_each "fmo_*"
