#!/usr/bin/env bash
# GPU call S (2 cards, session 8): call R's wider D1 (--width 3) trailed the preset (kappa 1.5) by 0.44 points at step
# 2,500 on seed 0 and 0.23 at step 1,500 on seed 1, so a narrower D1 (--width 1: 135k parameters instead of 200k), on
# call P's recipe (clip 0.1, lr 40), seeds 0 and 1, one per card; then the unconverted network on the same recipe.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40"
for card in 0 1; do
    ( train $card fms_width1_s$card $FM --group D1 --width 1 --seed $card --time-limit "$(left)"; wait
      train $card fms_none_s$card $FM --group none --seed $card --time-limit "$(left)"; wait ) &
done
wait
pack_each "fms_*"
