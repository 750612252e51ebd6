#!/usr/bin/env bash
# Idempotent set-up of the dev environment (.venv) on a Debian machine.
# Run from anywhere; it works in the repository root (the parent of scripts/).
# Progress lines go to stderr, so `run.sh main` keeps stdout for the demo.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }

# (a2) Fashion-MNIST for the main job: Debian's package puts the original IDX
# files in /usr/share/datasets/fashion-mnist. Not fatal when it cannot be
# installed: `equiconvert train --data-dir DIR` takes any copy.
fmnist=/usr/share/datasets/fashion-mnist
if [ -e "$fmnist/train-images-idx3-ubyte.gz" ]; then
    log "fashion-mnist: present in $fmnist"
elif [ "$(id -u)" -eq 0 ]; then
    log "fashion-mnist: installing Debian package dataset-fashion-mnist"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null && apt-get install -y -qq dataset-fashion-mnist >/dev/null; } \
        || log "fashion-mnist: could not install dataset-fashion-mnist; pass --data-dir to the main job"
else
    log "fashion-mnist: missing; install it with: sudo apt-get install dataset-fashion-mnist (or pass --data-dir)"
fi

# (b) Virtual environment.
if [ -x .venv/bin/python ] && [ -x .venv/bin/pip ]; then
    log "venv: .venv present"
else
    command -v python3 >/dev/null 2>&1 || die "python3 not found; install Python >= 3.10 (Debian: sudo apt-get install python3 python3-venv)"
    python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
        || die "Python >= 3.10 is required; python3 is $(python3 -c 'import platform; print(platform.python_version())')"
    log "venv: creating .venv with $(command -v python3) ($(python3 -c 'import platform; print(platform.python_version())'))"
    python3 -m venv .venv \
        || die "'python3 -m venv .venv' failed (Debian: sudo apt-get install python3-venv), then remove .venv and retry"
fi

# (c) torch/torchvision first, pinned to the releases that lie on this
# machine's local disk (pip serves them from there; a pip constraint file caps
# torch<=2.14.1). Letting the resolver pick them via pyproject could fetch
# other versions, several GB, from the internet.
if .venv/bin/python -c "import torch, torchvision" >/dev/null 2>&1; then
    log "torch: already installed"
else
    log "torch: installing torch==2.14.1 torchvision==0.29.1"
    .venv/bin/pip install -qq --disable-pip-version-check torch==2.14.1 torchvision==0.29.1
fi

# (d) The package itself, editable, with test extras, and escnn for the tests'
# cross-checks. escnn goes in with --no-deps plus what its planar code imports
# (scipy, joblib): its other dependencies, py3nj (Fortran) and lie_learn (NumPy 1
# only), serve SO(3) alone. Skipped while the stamp for pyproject.toml exists.
sha=$(sha256sum pyproject.toml | cut -c1-16)
stamp=".venv/.equiconvert-setup-$sha"
if [ -e "$stamp" ]; then
    log "equiconvert: up to date (pyproject.toml unchanged)"
else
    log "equiconvert: pip install -e .[test]"
    .venv/bin/pip install -qq --disable-pip-version-check -e ".[test]"
    .venv/bin/pip install -qq --disable-pip-version-check --no-deps escnn==1.0.11
    .venv/bin/pip install -qq --disable-pip-version-check scipy joblib
    rm -f .venv/.equiconvert-setup-*
    touch "$stamp"
fi
