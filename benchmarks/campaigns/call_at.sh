#!/usr/bin/env bash
# GPU call AT (4 cards, session 15). Carry .gpul, .eqc, .data/fashion-mnist, .data/cifar and .runs (holding a copy of
# benchmarks/results/campaign/call_aq/cifam_D4_eps8_s0, the CIFAR-10 run's step-887 checkpoint).
# Card 0: the CIFAR-10 eps 8 run of calls AM/AQ (the paper's D4 Equivariant-ResNet9 and hyper-parameters) resumed.
# Cards 1-3: Fashion-MNIST, calls AR/AS's recipe without crops (flips only, `--crop-padding 0`), seeds 0-2: the end of
# the crop series 4 -> 2 -> 1 -> 0 pixels.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-560}
left() { echo $((START + DEADLINE - $(date +%s))); }
CIFAR="--model equiconvert:equivariant_resnet9 --group D4 --dataset cifar10 --data-dir /tmp/cifar/cifar10 --epsilon 8 --delta 1e-5 --batch-size 8192 --steps 2200 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 512 --eval-every 100 --checkpoint-every 50"
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --test-shifts cross1 --crop-padding 0"
restore benchmarks/results/campaign/call_aq cifam_D4_eps8_s0
train 0 cifam_D4_eps8_s0 $CIFAR --seed 0 --time-limit "$(left)"
for seed in 0 1 2; do train $((seed + 1)) fmat_D1_crop0_s$seed $FM --seed $seed --time-limit "$(left)"; done
wait
pack_each "fmat_*"
tar czf "$RESULTS/cifam_D4_eps8_s0.tgz" -C "$RUNS" cifam_D4_eps8_s0
grep -o '"step": [0-9]*, "eval": {"accuracy": [0-9.]*' "$RUNS/cifam_D4_eps8_s0/log.jsonl" | tail -8
