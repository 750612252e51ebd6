#!/usr/bin/env bash
# GPU call AO (4 cards, session 14), Fashion-MNIST only. Carry .gpul, .eqc and .data/fashion-mnist (and .runs to resume).
# Calls AM/AN's recipe (call P's with 2-pixel crops and the cross1 test-time shifts) on the preset without its last
# residual block (--no-res2): 103,622 instead of 200,532 D1 parameters, so 0.72x the norm of DP-SGD's noise, at the
# price of the 4x4 stage's capacity. D1 seeds 0-2 on cards 0-2 (paired with call AM's seeds), the unconverted network
# without res2 (81k parameters) seeds 0-2 one after another on card 3.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-530}
left() { echo $((START + DEADLINE - $(date +%s))); }
BASE="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --test-shifts cross1 --crop-padding 2 --no-res2"
for seed in 0 1 2; do train $seed fmao_D1_nores2_s$seed $BASE --group D1 --seed $seed --time-limit "$(left)"; done
queue 3 "fmao_none_nores2_s0|--group none --seed 0" "fmao_none_nores2_s1|--group none --seed 1" \
    "fmao_none_nores2_s2|--group none --seed 2"
wait
pack_each "fmao_*"
