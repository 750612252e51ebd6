#!/usr/bin/env bash
# GPU call AS (4 cards, session 15), Fashion-MNIST only. Carry .gpul, .eqc and .data/fashion-mnist.
# Call AR again (crop shifts of at most 1 pixel, cross1 test-time shifts) on seeds 3-5, for a 6-seed median of both
# networks: D1 on cards 0-2, the unconverted network side by side on card 3.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-520}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --test-shifts cross1 --crop-padding 1"
for seed in 3 4 5; do train $((seed - 3)) fmas_D1_crop1_s$seed $FM --group D1 --seed $seed --time-limit "$(left)"; done
for seed in 3 4 5; do train 3 fmas_none_crop1_s$seed $FM --group none --seed $seed --time-limit "$(left)"; done
wait
pack_each "fmas_*"
