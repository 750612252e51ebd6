#!/usr/bin/env bash
# GPU call H (4 cards, session 4): Fashion-MNIST eps=3, the best schedule of call G's sweep (2000 steps, cosine
# decay, EMA 0.995) with the PRV accountant (sigma 2.275 instead of RDP's 2.427), the paper's layout converted to D1
# vs its plain network, 3 seeds each. Queues, deadline and resuming as in call_g.sh.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
BASE="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --max-grad-norm 2 --physical-batch-size 2304 --eval-every 250 --checkpoint-every 50 --aug-mult 4 --lr 2 --lr-schedule cosine --ema-decay 0.995 --batch-size 2048 --steps 2000"

queue 0 "fmh_D1_s0|--group D1 --seed 0" &
queue 1 "fmh_D1_s1|--group D1 --seed 1" &
queue 2 "fmh_D1_s2|--group D1 --seed 2" &
queue 3 "fmh_none_s0|--group none --seed 0" "fmh_none_s1|--group none --seed 1" "fmh_none_s2|--group none --seed 2" &
wait
pack_each "fmh_*"
