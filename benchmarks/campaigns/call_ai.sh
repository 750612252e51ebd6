#!/usr/bin/env bash
# GPU call AI (4 cards, session 12).
# Card 0: Opacus hooks on the paper's D4 model (fp32, Opacus' only precision) with the code before this session
# (`.old` = commit dec6b0c) and with the Triton norm kernels, alternating, twice each: Opacus' step time varied from
# 197 to 406 ms between hosts in calls AD, AG and AH, so only a same-card comparison can tell whether the kernels
# changed it. Set-up, in the checkout:
#   rm -rf .old && mkdir .old && git archive dec6b0c equiconvert benchmarks/throughput.py | tar x -C .old
# and carry .old with .gpul, .eqc and .data/fashion-mnist. The benchmark JSONs come back in one archive, bench.tgz.
# Cards 1-3: call P's Fashion-MNIST recipe (D1, clip 0.1, lr 40, EMA 0.995; 89.84 / 89.81 / 89.44%) with clip 0.02
# and lr 200 (lr x clip kept at 4, as from clip 2 to 0.1), on seeds 0-2.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --group D1 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304"
train 1 fmai_clip002_s0 $FM --max-grad-norm 0.02 --lr 200 --seed 0 --time-limit "$(left)"
train 2 fmai_clip002_s1 $FM --max-grad-norm 0.02 --lr 200 --seed 1 --time-limit "$(left)"
train 3 fmai_clip002_s2 $FM --max-grad-norm 0.02 --lr 200 --seed 2 --time-limit "$(left)"
export CUDA_VISIBLE_DEVICES=0
B="$RESULTS/bench"; mkdir -p "$B"
O="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 5 --methods nonprivate,bookkeeping:fastest,opacus"
for round in 1 2; do
    (cd .old && timeout 120 python benchmarks/throughput.py $O --out $B/fp32_opacus_before_$round.json) 2>&1 | tail -1
    timeout 120 python benchmarks/throughput.py $O --out $B/fp32_opacus_after_$round.json 2>&1 | tail -1
done
unset CUDA_VISIBLE_DEVICES
tar czf "$RESULTS/bench.tgz" -C "$RESULTS" bench && rm -rf "$B"
wait
pack_each "fmai_*"
