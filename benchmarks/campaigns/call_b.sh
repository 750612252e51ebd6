#!/usr/bin/env bash
# GPU call B (4 cards): resume the Fashion-MNIST runs of call A to their 1000 steps (one D1 run per card),
# rotated-MNIST seeds 1 and 2. Same run arguments as call A (a resumed run refuses a changed configuration).
source benchmarks/campaigns/common.sh
LIMIT=${LIMIT:-500}
FM="--dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --batch-size 2048 --steps 1000 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 256 --eval-every 100 --checkpoint-every 100"
RM="--dataset rotated-mnist --data-dir .data/mnist-10k.npz --epsilon 8 --delta 1e-5 --batch-size 512 --steps 300 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --no-flip --physical-batch-size 512 --eval-every 50 --checkpoint-every 50 --widths 16,32,64"
PAPER="--model equiconvert:equivariant_resnet9"
for s in 0 1 2; do
    train $s fmnist_paper_D1_eps3_s$s $PAPER --group D1 $FM --seed $s --time-limit $LIMIT
    train 3 fmnist_paper_none_eps3_s$s $PAPER --group none $FM --seed $s --time-limit $LIMIT
done
for s in 1 2; do
    train 3 rotmnist_resnet9_C8_eps8_s$s --model equiconvert:resnet9 --group C8 $RM --seed $s --time-limit $LIMIT
    train 3 rotmnist_resnet9_none_eps8_s$s --model equiconvert:resnet9 --group none $RM --seed $s --time-limit $LIMIT
done
wait
pack_each "*"
