#!/usr/bin/env bash
# GPU call L (4 cards, session 5): (1) CIFAR-10 eps=8, the paper's D4 Equivariant-ResNet9 and hyper-parameters as in
# call I (D4 at the default He scale: 47.1 / 55.0 / 60.0% at steps 100 / 200 / 300), with the steerable filters
# initialised at escnn's scale (--init-gain 1) and at half its variance (--init-gain 0.7071), for the call's time;
# (2) Fashion-MNIST, call J's schedule at the default He scale, seeds 1 and 2 (seed 0: 89.62% in call I).
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-480}
PAPER="--model equiconvert:equivariant_resnet9"
CIFAR="--dataset cifar10 --data-dir /tmp/cifar/cifar10 --epsilon 8 --delta 1e-5 --batch-size 8192 --steps 2200 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 512 --eval-every 100 --checkpoint-every 50"
FM="--dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --max-grad-norm 2 --physical-batch-size 2304 --eval-every 500 --checkpoint-every 50 --lr 2 --lr-schedule cosine --ema-decay 0.995 --aug-mult 2 --batch-size 2048 --steps 4000"
left() { echo $((START + DEADLINE - $(date +%s))); }
train 0 cifl_D4_gain1_eps8_s0 $PAPER --group D4 $CIFAR --init-gain 1 --seed 0 --time-limit "$(left)"
train 1 cifl_D4_gain0.71_eps8_s0 $PAPER --group D4 $CIFAR --init-gain 0.7071 --seed 0 --time-limit "$(left)"
train 2 fml_D1_k2_he_s1 $PAPER --group D1 $FM --seed 1 --time-limit "$(left)"
train 3 fml_D1_k2_he_s2 $PAPER --group D1 $FM --seed 2 --time-limit "$(left)"
wait
pack_each "*"
