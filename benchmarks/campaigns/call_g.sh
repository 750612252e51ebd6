#!/usr/bin/env bash
# GPU call G (4 cards, session 4): Fashion-MNIST eps=3 hyper-parameter sweep of the paper's layout restricted to D1
# (seed 0, K=4): EMA horizon, learning rate, cosine decay, longer schedules and a larger batch. Each card works
# through its queue until DEADLINE seconds after the start; a stopped run keeps its checkpoint and running this
# script again (with .runs carried back) resumes it. Finished runs are skipped.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
BASE="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --max-grad-norm 2 --physical-batch-size 1024 --eval-every 250 --checkpoint-every 50 --aug-mult 4"

S="--seed 0 --group D1"
queue 0 "fmg_lr2_ema995|$S --lr 2 --ema-decay 0.995 --batch-size 2048 --steps 1000" \
        "fmg_lr4_ema995|$S --lr 4 --ema-decay 0.995 --batch-size 2048 --steps 1000" &
queue 1 "fmg_lr2_cos_ema999|$S --lr 2 --lr-schedule cosine --ema-decay 0.999 --batch-size 2048 --steps 1000" \
        "fmg_lr4_cos_ema995|$S --lr 4 --lr-schedule cosine --ema-decay 0.995 --batch-size 2048 --steps 1000" &
queue 2 "fmg_lr2_cos_ema995_2000steps|$S --lr 2 --lr-schedule cosine --ema-decay 0.995 --batch-size 2048 --steps 2000" &
queue 3 "fmg_lr4_cos_ema995_b4096|$S --lr 4 --lr-schedule cosine --ema-decay 0.995 --batch-size 4096 --steps 1000" &
wait
pack_each "fmg_*"
