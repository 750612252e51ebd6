#!/usr/bin/env bash
# GPU call I (4 cards, session 4): CIFAR-10 eps=8 with the paper's hyper-parameters, its D4 Equivariant-ResNet9 and
# the plain network, one card each, from scratch for the call's time; and two Fashion-MNIST schedules with twice
# call H's steps at the same compute (K=2 with 4000 steps; batch 1024 with 4000 steps), D1, seed 0.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-500}
PAPER="--model equiconvert:equivariant_resnet9"
CIFAR="--dataset cifar10 --data-dir /tmp/cifar/cifar10 --epsilon 8 --delta 1e-5 --batch-size 8192 --steps 2200 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 512 --eval-every 100 --checkpoint-every 50"
FM="--dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --max-grad-norm 2 --physical-batch-size 2304 --eval-every 500 --checkpoint-every 50 --lr 2 --lr-schedule cosine --ema-decay 0.995"
left() { echo $((START + DEADLINE - $(date +%s))); }
train 0 cifar10_paper_D4_eps8_s0 $PAPER --group D4 $CIFAR --seed 0 --time-limit "$(left)"
train 1 cifar10_paper_none_eps8_s0 $PAPER --group none $CIFAR --seed 0 --time-limit "$(left)"
train 2 fmi_D1_k2_4000steps_s0 $PAPER --group D1 $FM --aug-mult 2 --batch-size 2048 --steps 4000 --seed 0 --time-limit "$(left)"
train 3 fmi_D1_b1024_4000steps_s0 $PAPER --group D1 $FM --aug-mult 4 --batch-size 1024 --steps 4000 --seed 0 --time-limit "$(left)"
wait
pack_each "*"
