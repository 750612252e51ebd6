#!/usr/bin/env bash
# GPU call M (4 cards, session 6; run twice, the second run resumes from the carried .runs): Fashion-MNIST eps=3,
# call J's schedule (K=2, batch 2048, lr 2 cosine, clip 2, EMA 0.995, PRV) stretched from 4000 to 7500 steps
# (1000 -> 2000 -> 4000 steps had each raised the D1 median), the paper preset at its default init gain 1/sqrt 2,
# seeds 0-2 on cards 0-2; the unconverted network on the same schedule, seeds 0-2 one after another on card 3.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-505}
BASE="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --max-grad-norm 2 --physical-batch-size 2304 --eval-every 500 --checkpoint-every 50 --lr 2 --lr-schedule cosine --ema-decay 0.995 --aug-mult 2 --batch-size 2048 --steps 7500"
queue 0 "fmm_D1_s0|--group D1 --seed 0" &
queue 1 "fmm_D1_s1|--group D1 --seed 1" &
queue 2 "fmm_D1_s2|--group D1 --seed 2" &
queue 3 "fmm_none_s0|--group none --seed 0" "fmm_none_s1|--group none --seed 1" "fmm_none_s2|--group none --seed 2" &
wait
pack_each "fmm_*"
