#!/usr/bin/env bash
# GPU call AK (4 cards, session 12), Fashion-MNIST only. Carry .gpul, .eqc and .data/fashion-mnist.
# Cards 1-3: call P's recipe (D1, clip 0.1, lr 40, EMA 0.995, 4,000 steps, PRV sigma 3.115) with 3 views per example
# instead of 2, under bf16 autocast so that a run fits one call (fp32 would take about 560 s of training), seeds 0-2.
# Card 0: the same with 2 views (bf16 only), seed 0: bf16's own effect on this recipe, paired with call AJ's
# fp32 control (89.84%).
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-570}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --batch-size 2048 --max-grad-norm 0.1 --lr 40 --precision bf16"
train 0 fmak_bf16_k2_s0 $FM --aug-mult 2 --physical-batch-size 2304 --seed 0 --time-limit "$(left)"
train 1 fmak_bf16_k3_s0 $FM --aug-mult 3 --physical-batch-size 2304 --seed 0 --time-limit "$(left)"
train 2 fmak_bf16_k3_s1 $FM --aug-mult 3 --physical-batch-size 2304 --seed 1 --time-limit "$(left)"
train 3 fmak_bf16_k3_s2 $FM --aug-mult 3 --physical-batch-size 2304 --seed 2 --time-limit "$(left)"
wait
pack_each "fmak_*"
