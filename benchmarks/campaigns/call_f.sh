#!/usr/bin/env bash
# GPU calls F1, F2 (2 cards, session 3): Fashion-MNIST eps=3, the paper's layout restricted to D1 vs its plain
# network, 3 seeds each, aug_mult 8 (call A had 4), book-keeping per-sample gradients. Each card works through its
# queue until DEADLINE seconds after the start; a run the deadline stops keeps its checkpoint, and running this
# script again (with .runs carried back) resumes it. Finished runs are skipped.
source benchmarks/campaigns/common.sh
START=$(date +%s); DEADLINE=${DEADLINE:-520}
FM="--dataset fashion-mnist --data-dir .data/fashion-mnist --epsilon 3 --delta 1e-5 --batch-size 2048 --steps 1000 --aug-mult 8 --lr 2 --max-grad-norm 2 --ema-decay 0.999 --physical-batch-size 1024 --eval-every 250 --checkpoint-every 50"
PAPER="--model equiconvert:equivariant_resnet9"

finished() { [ -f "$RUNS/$1/result.json" ] && python -c "import json,sys; d=json.load(open('$RUNS/$1/result.json')); sys.exit(0 if d['steps'] == d['requested_steps'] else 1)"; }

# queue GPU RUN... : the runs one after another on card GPU, each limited to the time left before the deadline
queue() {
    local gpu=$1; shift
    for spec in "$@"; do
        local group=${spec%%:*} seed=${spec##*:} name="fmnist_paper_${spec%%:*}_eps3_k8_s${spec##*:}"
        finished "$name" && continue
        local left=$((START + DEADLINE - $(date +%s)))
        [ "$left" -lt 30 ] && break
        train "$gpu" "$name" $PAPER --group "$group" $FM --seed "$seed" --time-limit "$left"
        wait $!
    done
}
queue 0 D1:0 D1:1 none:2 &
queue 1 D1:2 none:0 none:1 &
wait
nvidia-smi --query-gpu=name,memory.total --format=csv > "$RESULTS/gpus.csv"
for dir in "$RUNS"/fmnist_paper_*_k8_*; do tar czf "$RESULTS/$(basename "$dir").tgz" -C "$RUNS" "$(basename "$dir")"; done
for f in "$RUNS"/fmnist_paper_*_k8_*/result.json; do
    echo "$f $(python -c "import json; d=json.load(open('$f')); print(d['steps'], d.get('stopped_reason'), round(d['test_accuracy'],4), round(d['epsilon'],3), d.get('per_sample_method'), round(d.get('train_time_s',0)))")"
done
