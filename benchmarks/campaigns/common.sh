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

# train GPU NAME ARGS...: one `equiconvert train` run on card GPU, in the background, log in $RUNS/NAME/stdout.log
train() {
    local gpu=$1 name=$2; shift 2
    mkdir -p "$RUNS/$name"
    local resume=""; [ -f "$RUNS/$name/checkpoint.pt" ] && resume="--resume"
    CUDA_VISIBLE_DEVICES=$gpu python -m equiconvert train --out "$RUNS/$name" --no-progress --device cuda $resume "$@" \
        >>"$RUNS/$name/stdout.log" 2>&1 &
}

# pack: the run folders, checkpoints included, into $OUT (comes back), and a one-line summary per run
pack() {
    tar czf "$RESULTS/runs.tgz" .runs
    for f in "$RUNS"/*/result.json; do echo "$f $(python -c "import json,sys; d=json.load(open('$f')); print(d['steps'], d.get('stopped_reason'), round(d['test_accuracy'],4), round(d['epsilon'],3))")"; done
}
