#!/usr/bin/env bash
# GPU call AP (4 cards, session 14), Fashion-MNIST only. Carry .gpul, .eqc and .data/fashion-mnist (and .runs to resume).
# Call AO took res2 out (half the parameters) and lost 0.3 points: capacity binds more than the noise's dimension.
# Here the opposite trade: the same parameters with more capacity, res2 at 8x8 instead of 4x4 (--pool-after-res2;
# layer3's pooling moved after it). Calls AM/AN's recipe otherwise (2-pixel crops, cross1 test-time shifts).
# D1 seeds 0-2 on cards 0-2 (paired with call AM's seeds), the unconverted network the same way, seeds 0-2 side by
# side on card 3.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
BASE="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --test-shifts cross1 --crop-padding 2 --pool-after-res2"
for seed in 0 1 2; do train $seed fmap_D1_late_s$seed $BASE --group D1 --seed $seed --time-limit "$(left)"; done
for seed in 0 1 2; do train 3 fmap_none_late_s$seed $BASE --group none --seed $seed --time-limit "$(left)"; done
wait
pack_each "fmap_*"
