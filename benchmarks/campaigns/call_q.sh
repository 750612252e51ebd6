#!/usr/bin/env bash
# GPU call Q (2 cards, session 7): call P's Fashion-MNIST recipe (clip 0.1, lr 40; seed 0: 89.84% against the
# control's 89.66%) on seeds 1 and 2, one per card. Session 7's device time stopped them at steps 2867 and 2860; their
# folders (checkpoints included) are in benchmarks/results/campaign/call_q, from which a run resumes when .runs lacks it.
# Session 8: both finished in call R (call_r.sh resumed them); their folders now hold the finished runs, without checkpoints.
source benchmarks/campaigns/common.sh
restore benchmarks/results/campaign/call_q fmq_clip0.1_lr40_s1 fmq_clip0.1_lr40_s2
START=$(date +%s); DEADLINE=${DEADLINE:-380}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40"
train 0 fmq_clip0.1_lr40_s1 $FM --seed 1 --time-limit "$(left)"
train 1 fmq_clip0.1_lr40_s2 $FM --seed 2 --time-limit "$(left)"
wait
pack_each "fmq_*"
