#!/usr/bin/env bash
# GPU call V (2 cards; prepared in session 8, run in session 9: tanh 22.09%, SELU 89.61%): the activation of the paper's layout on Fashion-MNIST, paired
# with call P's seed-0 run (D1, clip 0.1, lr 40, Mish: 89.84%; same initial-weight seed, sampling and noise): tanh (the
# tempered sigmoid of Papernot et al. 2021) on card 0, SELU (Cheng et al.'s DPNAS) on card 1. If one gains more than
# 0.3 points, run seeds 1 and 2 and the unconverted network with the same activation (`--group none --activation ...`).
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --seed 0"
train 0 fmv_tanh_s0 $FM --activation tanh --time-limit "$(left)"
train 1 fmv_selu_s0 $FM --activation selu --time-limit "$(left)"
wait
pack_each "fmv_*"
