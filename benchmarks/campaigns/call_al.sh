#!/usr/bin/env bash
# GPU call AL (4 cards, session 13), Fashion-MNIST only. Carry .gpul, .eqc and .data/fashion-mnist.
# Call P's recipe (D1, clip 0.1, lr 40, EMA 0.995, 4,000 steps, PRV sigma 3.115, fp32) on seeds 0-2 and the
# unconverted network on the same seeds, each also evaluated with the softmax averaged over the test image and its
# four 1-pixel shifts (--test-shifts cross1, chosen on call O's seed-0 checkpoint before this call). Cards 0-2: the D1
# seeds; card 3: unconverted seeds 0 and 1 side by side; unconverted seed 2 shares card 2 with D1 seed 2.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-560}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --test-shifts cross1"
for seed in 0 1 2; do train $seed fmal_D1_s$seed $FM --group D1 --seed $seed --time-limit "$(left)"; done
train 3 fmal_none_s0 $FM --group none --seed 0 --time-limit "$(left)"
train 3 fmal_none_s1 $FM --group none --seed 1 --time-limit "$(left)"
train 2 fmal_none_s2 $FM --group none --seed 2 --time-limit "$(left)"
wait
pack_each "fmal_*"
