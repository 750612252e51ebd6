#!/usr/bin/env bash
# GPU call X (2 cards, session 9): two changes to the DP step, against the code before them side by side on card 0
# (`.old`: the tree of commit c2021e8), while card 1 trains Fashion-MNIST with the new bf16 numerics:
# - "unfolded": a third per-example filter-gradient kernel (the taps stacked into one wide product), which "fastest"
#   times with the other two;
# - FieldGroupNorm returns its input's dtype (bf16 under autocast) instead of fp32, statistics still in fp32 (commit
#   d4642eb; reverted after this call: no speed gain, benchmarks/RESULTS.md). Rerunning this script today measures the
#   "unfolded" kernel alone.
# Before the call, in the checkout:
#   echo /.old/ >> .git/info/exclude; rm -rf .old; mkdir .old && git archive c2021e8 equiconvert benchmarks/throughput.py | tar x -C .old
# and carry .old with .gpul, .eqc and .data/fashion-mnist.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-450}
left() { echo $((START + DEADLINE - $(date +%s))); }
# card 1: call N's seed-0 bf16 run (89.51%) again, with the norms' outputs in bf16
FM="--model equiconvert:equivariant_resnet9 --dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --accountant prv --max-grad-norm 2 --physical-batch-size 2304 --eval-every 500 --checkpoint-every 50 --lr 2 --lr-schedule cosine --ema-decay 0.995 --aug-mult 2 --batch-size 2048"
train 1 fmx_D1_bf16_s0 $FM --group D1 --steps 4000 --precision bf16 --seed 0 --time-limit "$(left)"
export CUDA_VISIBLE_DEVICES=0
T="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 10"
(cd .old && timeout 150 python benchmarks/throughput.py $T --precision bf16 --methods nonprivate,bookkeeping:products,bookkeeping:fastest --out $RESULTS/throughput_paper_d4_512x4_bf16_before.json) 2>&1 | tail -2
timeout 150 python benchmarks/throughput.py $T --precision bf16 --methods nonprivate,bookkeeping:products,bookkeeping:unfolded,bookkeeping:fastest --out $RESULTS/throughput_paper_d4_512x4_bf16_after.json 2>&1 | tail -2
timeout 150 python benchmarks/throughput.py $T --precision fp32 --methods nonprivate,bookkeeping:products,bookkeeping:unfolded,bookkeeping:fastest --out $RESULTS/throughput_paper_d4_512x4_fp32_after.json 2>&1 | tail -2
timeout 150 python benchmarks/filter_gradients.py --device cuda --batch 512 --aug-mult 4 --dtype bf16 --out $RESULTS/filter_gradients_bf16.json 2>&1 | tail -1
timeout 150 python benchmarks/profile_step.py --device cuda --model paper --batch 512 --aug-mult 4 --precision bf16 --cudnn-benchmark --filter-gradients fastest --top 12 --out $RESULTS/profile_paper_d4_512x4_bf16.json 2>&1 | tail -1
unset CUDA_VISIBLE_DEVICES
wait
pack_each "fmx_*"
