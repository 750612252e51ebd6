#!/usr/bin/env bash
# GPU calls F1, F2 (2 cards, session 3): Fashion-MNIST eps=3, the paper's layout restricted to D1 vs its plain
# network, 3 seeds each, aug_mult 8 (call A had 4), book-keeping per-sample gradients. Each card works through its
# queue until DEADLINE seconds after the start; a run the deadline stops keeps its checkpoint, and running this
# script again (with .runs carried back) resumes it. Finished runs are skipped.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-520}
FM="--dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --batch-size 2048 --steps 1000 --aug-mult 8 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 1024 --eval-every 250 --checkpoint-every 50"
PAPER="--model equiconvert:equivariant_resnet9"

BASE="$PAPER $FM"
run() { echo "fmnist_paper_$1_eps3_k8_s$2|--group $1 --seed $2"; }
queue 0 "$(run D1 0)" "$(run D1 1)" "$(run none 2)" &
queue 1 "$(run D1 2)" "$(run none 0)" "$(run none 1)" &
wait
pack_each "fmnist_paper_*_k8_*"
