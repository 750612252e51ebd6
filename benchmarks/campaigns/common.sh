# Shared set-up of the GPU campaigns (sourced): lent GPU machine, 4 cards, no network.
# Carried: .gpul (opacus/escnn wheels), .eqc (warm basis cache: escnn is never imported), .data, and .runs
# (the run folders with their checkpoints, so a later call resumes the runs a time limit stopped).
set -u
source .gpul/activate.sh
export EQUICONVERT_CACHE_DIR="$PWD/.eqc" PYTHONUNBUFFERED=1
RESULTS="${OUT:-/tmp/out}"
RUNS=.runs
mkdir -p "$RUNS" "$RESULTS"
if [ -f .data/cifar/cifar10-jpeg.tar.xz ] && [ ! -d /tmp/cifar/cifar10 ]; then
    mkdir -p /tmp/cifar && tar xJf .data/cifar/cifar10-jpeg.tar.xz -C /tmp/cifar
fi

# restore DIR NAME...: each run folder NAME missing from $RUNS copied from DIR (a committed campaign folder, checkpoint
# included), so that `train` resumes it
restore() {
    local dir=$1; shift
    for name in "$@"; do [ -d "$RUNS/$name" ] || cp -r "$dir/$name" "$RUNS/"; done
}

# train GPU NAME ARGS...: one `equiconvert train` run on card GPU, in the background, log in $RUNS/NAME/stdout.log.
# 8 CPU threads each: four processes with a thread per core each ran 1.5x slower (call G).
train() {
    local gpu=$1 name=$2; shift 2
    mkdir -p "$RUNS/$name"
    local resume=""; [ -f "$RUNS/$name/checkpoint.pt" ] && resume="--resume"
    CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} python -m equiconvert train --out "$RUNS/$name" --no-progress --device cuda $resume "$@" \
        >>"$RUNS/$name/stdout.log" 2>&1 &
}

# finished NAME: true when the run's result.json says it reached its requested steps
finished() { [ -f "$RUNS/$1/result.json" ] && python -c "import json,sys; d=json.load(open('$RUNS/$1/result.json')); sys.exit(0 if d['steps'] == d['requested_steps'] else 1)"; }

# queue GPU "NAME|ARGS"... : the runs one after another on card GPU (common arguments in $BASE), skipping finished
# ones, each limited to the time left before $START + $DEADLINE; a stopped run keeps its checkpoint and resumes
# when the script runs again
queue() {
    local gpu=$1; shift
    for spec in "$@"; do
        local name=${spec%%|*} args=${spec#*|}
        finished "$name" && continue
        local left=$((START + DEADLINE - $(date +%s)))
        [ "$left" -lt 30 ] && break
        train "$gpu" "$name" $BASE $args --time-limit "$left"
        wait $!
    done
}

# pack_each GLOB: the card list, and each run folder matching GLOB (checkpoints included) as its own archive in $OUT,
# so that no archive passes the 16 MiB transfer limit; then a one-line summary per run
pack_each() {
    nvidia-smi --query-gpu=name,memory.total --format=csv > "$RESULTS/gpus.csv"
    for dir in "$RUNS"/$1; do tar czf "$RESULTS/$(basename "$dir").tgz" -C "$RUNS" "$(basename "$dir")"; done
    for f in "$RUNS"/$1/result.json; do
        echo "$f $(python -c "import json; d=json.load(open('$f')); print(d['steps'], d.get('stopped_reason'), round(d['test_accuracy'],4), round(d['epsilon'],3), d.get('noise_multiplier'), d.get('per_sample_method'), round(d.get('train_time_s',0)))")"
    done
}
