#!/usr/bin/env bash
# GPU call AM (4 cards, session 13). Carry .gpul, .eqc, .data/fashion-mnist and .data/cifar (and .runs to resume).
# Card 0: CIFAR-10 eps 8, the paper's D4 Equivariant-ResNet9 and hyper-parameters (batch 8192 x 4, lr 2, clip 2,
# EMA 0.999, 2,200 steps planned) at the preset's init gain 1/sqrt 2, from scratch; call L stopped the same run at
# step 318 (65.7%). Its checkpoint (step 440) is kept in benchmarks/results/campaign/call_am/cifam_D4_eps8_s0: a later
# call resumes it with `restore benchmarks/results/campaign/call_am cifam_D4_eps8_s0` before the `train` line.
# Cards 1-3: Fashion-MNIST, call P's recipe with the two changes whose paired effects were positive on average:
# crop shifts of at most 2 pixels (call AC: +0.03 / -0.09 / +0.25) and the cross1 test-time shifts (call AL: +0.03 /
# +0.31 / +0.06), seeds 0-2.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-520}
left() { echo $((START + DEADLINE - $(date +%s))); }
CIFAR="--model equiconvert:equivariant_resnet9 --group D4 --dataset cifar10 --data-dir /tmp/cifar/cifar10 --epsilon 8 --delta 1e-5 --batch-size 8192 --steps 2200 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 512 --eval-every 100 --checkpoint-every 50"
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --test-shifts cross1 --crop-padding 2"
train 0 cifam_D4_eps8_s0 $CIFAR --seed 0 --time-limit "$(left)"
for seed in 0 1 2; do train $((seed + 1)) fmam_D1_crop2_s$seed $FM --seed $seed --time-limit "$(left)"; done
wait
pack_each "*am_*"
