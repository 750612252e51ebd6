#!/usr/bin/env bash
# GPU call AR (4 cards, session 15), Fashion-MNIST only. Carry .gpul, .eqc and .data/fashion-mnist.
# Call AM's recipe with crop shifts of at most 1 pixel instead of 2 (4 -> 2 gained +0.22 / +0.35 / +0.33 paired in
# calls AL/AM): D1 seeds 0-2 on cards 0-2, the unconverted network on the same recipe, seeds 0-2 side by side on card 3.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-520}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --test-shifts cross1 --crop-padding 1"
for seed in 0 1 2; do train $seed fmar_D1_crop1_s$seed $FM --group D1 --seed $seed --time-limit "$(left)"; done
for seed in 0 1 2; do train 3 fmar_none_crop1_s$seed $FM --group none --seed $seed --time-limit "$(left)"; done
wait
pack_each "fmar_*"
