"""The options of `equiconvert audit` and their defaults, without torch: the command line's help and choices show
them (training/audit.py runs the audit)."""

from __future__ import annotations

from typing import Any

DEFAULT_BETA = 0.05  # 1 - the confidence of the lower bound
# DPConfig fields of the `equiconvert audit` command where DPConfig's (CIFAR-10-scale) defaults do not fit a
# small audit: no augmentation or EMA (one clean signal per canary), batches a small data set can hold
AUDIT_DEFAULTS: dict[str, Any] = {
    "target_epsilon": 1.0,
    "batch_size": 64,
    "steps": 100,
    "aug_mult": 1,
    "augment_padding": 0,
    "augment_flip": False,
    "ema_decay": None,
    "lr": 1.0,
    "max_grad_norm": 1.0,
}
GRADIENT_SCORE = "gradient"  # white-box: the weight change's alignment with each canary's gradient
LOSS_SCORE = "loss"  # black-box: minus the trained model's loss on each canary
SCORE_NAMES = (GRADIENT_SCORE, LOSS_SCORE)
LINEAR_MODEL = "linear"
CNN_MODEL = "cnn"
CANONICALIZED_MODEL = "canonicalized_cnn"  # the small CNN behind a C4 canonicaliser (equiconvert.canonicalize)
SMALL_MODEL_NAMES = (LINEAR_MODEL, CNN_MODEL, CANONICALIZED_MODEL)  # the small models an audit trains
