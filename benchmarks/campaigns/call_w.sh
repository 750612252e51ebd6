#!/usr/bin/env bash
# GPU call W (2 cards, session 9): two more single changes paired with call P's seed-0 run (D1, clip 0.1, lr 40:
# 89.84%; same initial weights, sampling and noise): crops without flips (`--no-flip`: Fashion-MNIST's shoes all point
# one way, and the flip-equivariant layers already cover mirror images) on card 0; heavy-ball momentum 0.9 at lr 4
# (the same long-run step size, lr / (1 - momentum) = 40) on card 1. Ran in session 9: 89.61% and 88.53%.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --seed 0"
train 0 fmw_noflip_s0 $FM --lr 40 --no-flip --time-limit "$(left)"
train 1 fmw_momentum_s0 $FM --lr 4 --momentum 0.9 --time-limit "$(left)"
wait
pack_each "fmw_*"
