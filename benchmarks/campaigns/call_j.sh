#!/usr/bin/env bash
# GPU call J (4 cards, session 5): Fashion-MNIST eps=3, call I's best schedule (D1, K=2, batch 2048, 4000 steps, PRV,
# cosine, EMA 0.995) with the steerable filters initialised at escnn's scale (--init-gain 1, seeds 0 and 1) and at half
# its variance (--init-gain 0.7071, seed 0), against call I's seed 0 at the default He scale (89.62%); and the
# unconverted network on the same schedule, seeds 0-2, one after another on the fourth card.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-500}
PAPER="--model equiconvert:equivariant_resnet9"
FM="--dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --max-grad-norm 2 --physical-batch-size 2304 --eval-every 500 --checkpoint-every 50 --lr 2 --lr-schedule cosine --ema-decay 0.995 --aug-mult 2 --batch-size 2048 --steps 4000"
left() { echo $((START + DEADLINE - $(date +%s))); }
train 0 fmj_D1_k2_gain1_s0 $PAPER --group D1 $FM --init-gain 1 --seed 0 --time-limit "$(left)"
train 1 fmj_D1_k2_gain0.71_s0 $PAPER --group D1 $FM --init-gain 0.7071 --seed 0 --time-limit "$(left)"
train 2 fmj_D1_k2_gain1_s1 $PAPER --group D1 $FM --init-gain 1 --seed 1 --time-limit "$(left)"
BASE="$PAPER --group none $FM"
queue 3 "fmj_none_k2_s0|--seed 0" "fmj_none_k2_s1|--seed 1" "fmj_none_k2_s2|--seed 2" &
wait
pack_each "fmj_*"
