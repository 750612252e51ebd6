#!/usr/bin/env bash
# GPU call AN (4 cards, session 13), Fashion-MNIST only. Carry .gpul, .eqc and .data/fashion-mnist.
# Call AM's recipe (call P's with crop shifts of at most 2 pixels and the cross1 test-time shifts) on three more seeds
# (3-5, cards 0-2), and the unconverted network on the same recipe, seeds 0-2 side by side on card 3.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-470}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --test-shifts cross1 --crop-padding 2"
for seed in 3 4 5; do train $((seed - 3)) fman_D1_crop2_s$seed $FM --group D1 --seed $seed --time-limit "$(left)"; done
for seed in 0 1 2; do train 3 fman_none_crop2_s$seed $FM --group none --seed $seed --time-limit "$(left)"; done
wait
pack_each "fman_*"
