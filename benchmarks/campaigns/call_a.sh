#!/usr/bin/env bash
# GPU call A (4 cards): CIFAR-10 paper model D4 vs its plain network, Fashion-MNIST eps=3, rotated MNIST eps=8,
# throughput of the paper's model. Each training run stops at --time-limit with a checkpoint; call B resumes.
source benchmarks/campaigns/common.sh
LIMIT=${LIMIT:-450}
FM="--dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --batch-size 2048 --steps 1000 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 256 --eval-every 100 --checkpoint-every 100"
CIFAR="--dataset cifar10 --data-dir /tmp/cifar/cifar10 --epsilon 8 --delta 1e-5 --batch-size 8192 --steps 2200 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 512 --eval-every 100 --checkpoint-every 50"
RM="--dataset rotated-mnist --data-dir .data/mnist-10k.npz --epsilon 8 --delta 1e-5 --batch-size 512 --steps 300 --aug-mult 4 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --no-flip --physical-batch-size 512 --eval-every 50 --checkpoint-every 50 --widths 16,32,64"
PAPER="--model equiconvert:equivariant_resnet9"

train 0 cifar10_paper_D4_eps8_s0 $PAPER --group D4 $CIFAR --seed 0 --time-limit $LIMIT
for s in 0 1 2; do
    train 2 fmnist_paper_D1_eps3_s$s $PAPER --group D1 $FM --seed $s --time-limit $LIMIT
    train 3 fmnist_paper_none_eps3_s$s $PAPER --group none $FM --seed $s --time-limit $LIMIT
done
train 3 fmnist_resnet9_D1_cosine_eps3_s0 --model equiconvert:resnet9 --widths 16,32,64 --group D1 $FM --lr-schedule cosine --seed 0 --time-limit $LIMIT
# card 1: the throughput benchmark alone first, then the cheaper runs
CUDA_VISIBLE_DEVICES=1 python benchmarks/throughput.py --model paper --device cuda --batch 512 --aug-mult 4 \
    --methods nonprivate,equiconvert,equiconvert@256,opacus,nested_vmap --out "$RESULTS/throughput_paper_d4_512x4.json" \
    > "$RESULTS/throughput.log" 2>&1
train 1 cifar10_paper_none_eps8_s0 $PAPER --group none $CIFAR --seed 0 --time-limit $((LIMIT - 150))
train 1 rotmnist_resnet9_C8_eps8_s0 --model equiconvert:resnet9 --group C8 $RM --seed 0 --time-limit $((LIMIT - 150))
train 1 rotmnist_resnet9_none_eps8_s0 --model equiconvert:resnet9 --group none $RM --seed 0 --time-limit $((LIMIT - 150))
wait
nvidia-smi --query-gpu=name,memory.total --format=csv > "$RESULTS/gpus.csv"
pack_each "*"
