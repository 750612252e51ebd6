#!/usr/bin/env bash
# GPU call U (2 cards, session 8; card 0 only): the aligned filter-gradient products against the code before them
# (commit 74449b6), side by side on one H200, nothing else running. Before the call, in the checkout:
#   echo /.old/ >> .git/info/exclude; mkdir .old && git archive 74449b6 equiconvert benchmarks/throughput.py | tar x -C .old
# and carry .old with .gpul and .eqc.
source .gpul/activate.sh && export EQUICONVERT_CACHE_DIR=$PWD/.eqc
T="--device cuda --model paper --batch 512 --aug-mult 4 --cudnn-benchmark --iters 10"
(cd .old && python benchmarks/throughput.py $T --precision bf16 --methods nonprivate,bookkeeping:products,bookkeeping:fastest --out $OUT/throughput_paper_d4_512x4_bf16_before_alignment.json)
python benchmarks/throughput.py $T --precision bf16 --methods nonprivate,bookkeeping:products,bookkeeping:fastest --out $OUT/throughput_paper_d4_512x4_bf16_aligned.json
python benchmarks/throughput.py $T --precision fp32 --methods nonprivate,bookkeeping:products,bookkeeping:fastest --out $OUT/throughput_paper_d4_512x4_fp32_aligned.json
