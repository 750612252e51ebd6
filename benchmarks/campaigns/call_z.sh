#!/usr/bin/env bash
# GPU call Z (4 cards, session 10): call Y's best change, GroupNorm with 16 groups (`--norm-groups 16`; seed 0 90.00%
# vs call P's 89.84% with the paper's 8, and 4 groups 89.38%), on seeds 1 and 2 (cards 0, 1), and the unconverted
# network with the same 16 groups on seeds 0-2 (cards 2, 3), same budget and schedule. Card 3 then measures the DP step
# of the paper's D4 model in bf16 with each filter-gradient kernel alone ("unfolded" alone was never measured at step
# level) and "fastest".
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { echo $((START + DEADLINE - $(date +%s))); }
FM="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --eval-every 500 --checkpoint-every 50 --lr-schedule cosine --ema-decay 0.995 --steps 4000 --aug-mult 2 --batch-size 2048 --physical-batch-size 2304 --max-grad-norm 0.1 --lr 40 --norm-groups 16"
train 0 fmz_D1_groups16_s1 $FM --group D1 --seed 1 --time-limit "$(left)"
train 1 fmz_D1_groups16_s2 $FM --group D1 --seed 2 --time-limit "$(left)"
BASE="$FM --group none"
queue 2 "fmz_none_groups16_s0|--seed 0" "fmz_none_groups16_s1|--seed 1" &
(
    queue 3 "fmz_none_groups16_s2|--seed 2"
    T="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 10"
    export CUDA_VISIBLE_DEVICES=3
    left=$(( $(left) - 15 ))
    [ "$left" -gt 60 ] && timeout "$left" python benchmarks/throughput.py $T --precision bf16 \
        --methods nonprivate,bookkeeping:products,bookkeeping:grouped,bookkeeping:unfolded,bookkeeping:fastest \
        --out $RESULTS/throughput_paper_d4_512x4_bf16_kernels.json 2>&1 | tail -3
) &
wait
pack_each "fmz_*"
