#!/usr/bin/env bash
# GPU call AA (4 cards, session 10): call P's recipe (D1, clip 0.1, lr 40, GroupNorm 8, EMA 0.995: 89.84 / 89.81 /
# 89.44%, median 89.81%) with a longer EMA horizon, 0.999 (about the last 1,000 of 4,000 steps, where the cosine
# learning rate is under 15% of its start), on seeds 0-2 (cards 0-2), and 0.998 on seed 0 (card 3). Same initial
# weights, Poisson batches, augmentations and noise as the seed-matched runs of calls P, Q and R.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40"
train 0 fmaa_ema999_s0 $FM --ema-decay 0.999 --seed 0 --time-limit "$(left)"
train 1 fmaa_ema999_s1 $FM --ema-decay 0.999 --seed 1 --time-limit "$(left)"
train 2 fmaa_ema999_s2 $FM --ema-decay 0.999 --seed 2 --time-limit "$(left)"
train 3 fmaa_ema998_s0 $FM --ema-decay 0.998 --seed 0 --time-limit "$(left)"
wait
pack_each "fmaa_*"
