#!/usr/bin/env bash
# GPU call D (one H200): throughput of every per-sample method (book-keeping included) on three models, then
# the CIFAR-10 runs of call A resumed from their last checkpoint with book-keeping, for the time left.
source benchmarks/campaigns/common.sh
M=nonprivate,equiconvert@256,bookkeeping,bookkeeping@256,bookkeeping@128,opacus,nested_vmap
python benchmarks/throughput.py --model paper --device cuda --batch 512 --aug-mult 4 --methods $M \
    --out "$RESULTS/throughput_h200_paper_d4_512x4_bk.json" 2>&1 | grep -v Warn
python benchmarks/throughput.py --widths 16,32,64 --device cuda --batch 512 --aug-mult 4 --methods $M \
    --out "$RESULTS/throughput_h200_resnet9_16-32-64_bk.json" 2>&1 | grep -v Warn
python benchmarks/throughput.py --widths 64,128,256 --device cuda --batch 256 --aug-mult 4 \
    --methods nonprivate,equiconvert@64,bookkeeping,bookkeeping@128,opacus,nested_vmap \
    --out "$RESULTS/throughput_h200_resnet9_64-128-256_bk.json" 2>&1 | grep -v Warn
LIMIT=${LIMIT:-240}
CIFAR="--dataset cifar10 --data-dir /tmp/cifar/cifar10 --epsilon 8 --delta 1e-5 --batch-size 8192 --steps 2200 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 512 --eval-every 100 --checkpoint-every 50"
train 0 cifar10_paper_D4_eps8_s0 --model equiconvert:equivariant_resnet9 --group D4 $CIFAR --seed 0 --time-limit $LIMIT --per-sample bookkeeping
train 0 cifar10_paper_none_eps8_s0 --model equiconvert:equivariant_resnet9 --group none $CIFAR --seed 0 --time-limit $LIMIT --per-sample bookkeeping
wait
tar czf "$RESULTS/runs.tgz" --exclude=checkpoint.pt .runs
for f in "$RUNS"/*/result.json; do python -c "import json; d=json.load(open('$f')); print('$f', d['steps'], d['stopped_reason'], d['test_accuracy'], d['epsilon'], d.get('per_sample_method'))"; done
