#!/usr/bin/env bash
# GPU call AQ (4 cards, session 14). Carry .gpul, .eqc, .data/fashion-mnist, .data/cifar and .runs (holding a copy of
# benchmarks/results/campaign/call_am/cifam_D4_eps8_s0, the CIFAR-10 run's step-440 checkpoint).
# Card 0: the CIFAR-10 eps 8 run of call AM (the paper's D4 Equivariant-ResNet9 and hyper-parameters) resumed.
# Cards 1-3: Fashion-MNIST, calls AM/AN's recipe (2-pixel crops, cross1 test-time shifts) with a wider D1 model,
# kappa 2 (fields 16, 32, 64: 273,402 parameters) between the preset's kappa 1.5 and call R's kappa 3, seeds 0-2
# (paired with call AM's seeds). Calls AO and AP: half the parameters lost 0.3 points, res2 at 8x8 gained nothing.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-530}
left() { echo $((START + DEADLINE - $(date +%s))); }
CIFAR="--model equiconvert:equivariant_resnet9 --group D4 --dataset cifar10 --data-dir /tmp/cifar/cifar10 --epsilon 8 --delta 1e-5 --batch-size 8192 --steps 2200 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 512 --eval-every 100 --checkpoint-every 50"
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --test-shifts cross1 --crop-padding 2 --width 2"
restore benchmarks/results/campaign/call_am cifam_D4_eps8_s0
train 0 cifam_D4_eps8_s0 $CIFAR --seed 0 --time-limit "$(left)"
for seed in 0 1 2; do train $((seed + 1)) fmaq_D1_kappa2_s$seed $FM --seed $seed --time-limit "$(left)"; done
wait
pack_each "fmaq_*"
tar czf "$RESULTS/cifam_D4_eps8_s0.tgz" -C "$RUNS" cifam_D4_eps8_s0
grep -o '"step": [0-9]*, "eval": {"accuracy": [0-9.]*' "$RUNS/cifam_D4_eps8_s0/log.jsonl" | tail -8
