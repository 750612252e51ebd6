#!/usr/bin/env bash
# GPU call AJ (4 cards, session 12), Fashion-MNIST only. Carry .gpul, .eqc and .data/fashion-mnist.
# Card 0: call P's recipe unchanged on seed 0 (D1, clip 0.1, lr 40, EMA 0.995, 4,000 steps; call P had 89.84% on an
# H100 with the code of session 7): the first training run on the Triton norm kernels, whose fp32 arithmetic differs
# from the torch path's only in summation order.
# Cards 1-3: the same recipe stretched to 5,000 steps (PRV sigma recalibrated for epsilon 3), seeds 0-2: 2,000 ->
# 4,000 steps raised the median and 7,500 (clip 2) lowered it.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-570}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40"
train 0 fmaj_control_s0 $FM --steps 4000 --seed 0 --time-limit "$(left)"
train 1 fmaj_5000steps_s0 $FM --steps 5000 --seed 0 --time-limit "$(left)"
train 2 fmaj_5000steps_s1 $FM --steps 5000 --seed 1 --time-limit "$(left)"
train 3 fmaj_5000steps_s2 $FM --steps 5000 --seed 2 --time-limit "$(left)"
wait
pack_each "fmaj_*"
