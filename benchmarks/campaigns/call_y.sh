#!/usr/bin/env bash
# GPU call Y (4 cards, session 10): four single changes paired with call P's seed-0 run (D1, clip 0.1, lr 40, Mish,
# GroupNorm 8 groups: 89.84%; same initial weights, Poisson batches, augmentations and noise): the preset's GroupNorm
# with 4 and with 16 groups (`--norm-groups`; a converted norm takes at most one group per field: 13, 16, 16 groups of
# the 13-, 27- and 55-field layers with 16), and the learning rate at clip 0.1 swept down and up (lr 28, lr 56; lr 40
# was set from clip 2's lr 2 by keeping lr x clip, never swept at clip 0.1).
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --seed 0"
train 0 fmy_groups4_s0 $FM --lr 40 --norm-groups 4 --time-limit "$(left)"
train 1 fmy_groups16_s0 $FM --lr 40 --norm-groups 16 --time-limit "$(left)"
train 2 fmy_lr28_s0 $FM --lr 28 --time-limit "$(left)"
train 3 fmy_lr56_s0 $FM --lr 56 --time-limit "$(left)"
wait
pack_each "fmy_*"
