#!/usr/bin/env bash
# GPU call K (4 cards, session 5): call J's schedule (Fashion-MNIST eps=3, D1, K=2, batch 2048, 4000 steps, PRV,
# cosine, EMA 0.995). Seeds 1 and 2 at --init-gain 0.7071 (seed 0: 89.85% in call J); seed 0 at --init-gain 0.5 and
# at --init-gain 0.7071 with lr 3; and the end of call J's unconverted seed 2 (resumed from its checkpoint in .runs).
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-500}
PAPER="--model equiconvert:equivariant_resnet9"
FM="--dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --max-grad-norm 2 --physical-batch-size 2304 --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --aug-mult 2 --batch-size 2048 --steps 4000"
left() { echo $((START + DEADLINE - $(date +%s))); }
train 0 fmk_D1_k2_gain0.71_s1 $PAPER --group D1 $FM --lr 2 --init-gain 0.7071 --seed 1 --time-limit "$(left)"
train 1 fmk_D1_k2_gain0.71_s2 $PAPER --group D1 $FM --lr 2 --init-gain 0.7071 --seed 2 --time-limit "$(left)"
train 2 fmk_D1_k2_gain0.5_s0 $PAPER --group D1 $FM --lr 2 --init-gain 0.5 --seed 0 --time-limit "$(left)"
train 3 fmk_D1_k2_gain0.71_lr3_s0 $PAPER --group D1 $FM --lr 3 --init-gain 0.7071 --seed 0 --time-limit "$(left)"
train 3 fmj_none_k2_s2 $PAPER --group none $FM --lr 2 --seed 2 --time-limit "$(left)"
wait
pack_each "fm*"
