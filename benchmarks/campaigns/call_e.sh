#!/usr/bin/env bash
# GPU call E (one H200, session 3): throughput after the shifted-product book-keeping filter gradients,
# side by side with vmap, Opacus and nested vmap, on the paper's models (D4, D1, plain) and converted ResNet9s.
source benchmarks/campaigns/common.sh
nvidia-smi --query-gpu=name,memory.total --format=csv > "$RESULTS/gpus.csv"
tp() { python benchmarks/throughput.py --device cuda "$@" 2>&1 | grep -v -i warn; }
tp --model paper --batch 512 --aug-mult 4 --methods nonprivate,bookkeeping,bookkeeping@256,equiconvert@256,opacus,nested_vmap \
    --out "$RESULTS/throughput_h200_paper_d4_512x4_v3.json"
tp --model paper --batch 512 --aug-mult 4 --methods nonprivate,bookkeeping,equiconvert@256 --cudnn-benchmark \
    --out "$RESULTS/throughput_h200_paper_d4_512x4_v3_cudnn_benchmark.json"
for g in D1 none; do
    tp --model paper --group $g --batch 512 --aug-mult 4 --methods nonprivate,bookkeeping,equiconvert@256 \
        --out "$RESULTS/throughput_h200_paper_${g}_512x4_v3.json"
done
tp --widths 16,32,64 --batch 512 --aug-mult 4 --methods nonprivate,bookkeeping,equiconvert@256,opacus \
    --out "$RESULTS/throughput_h200_resnet9_16-32-64_v3.json"
tp --widths 64,128,256 --batch 256 --aug-mult 4 --methods nonprivate,bookkeeping,equiconvert@64,opacus \
    --out "$RESULTS/throughput_h200_resnet9_64-128-256_v3.json"
