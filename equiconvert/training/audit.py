"""Empirical privacy audit of a DP-SGD configuration from one training run.

The one-run audit of Steinke, Nasr and Jagielski, "Privacy auditing with one (1) training run"
(NeurIPS 2023): m canaries are each added to the training set independently with probability 1/2,
the model is trained once with DPTrainer, every canary gets a membership score, the auditor guesses
"included" for the k+ highest scores and "excluded" for the k- lowest, and the number of correct
guesses gives an epsilon lower bound at confidence 1 - beta (audit_bound.epsilon_lower_bound). A
correct implementation keeps the lower bound below the accountant's epsilon (with probability at
least 1 - beta); a bound above it proves the run leaked more than its accountant claims.

Canaries are out-of-distribution inputs (uniform random pixels) with random labels, so nothing
but their own presence teaches the model their labels. The default score is white-box: the weight
change projected on each canary's gradient. Every step that samples a canary moves the weights
along its (clipped) gradient, so this signal grows with the number of such steps while DP-SGD's
noise along one direction grows only with its square root, and the paper's white-box audits give
higher bounds than black-box ones. "loss" (minus the trained model's loss) needs only the model's
outputs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from ..errors import ParameterError, ParameterTypeError
from ..privacy.audit_bound import epsilon_lower_bound
from ..privacy.dp_step import per_sample_norms
from ..adapt.canonicalize import canonicalize
from .audit_options import CANONICALIZED_MODEL, CNN_MODEL, DEFAULT_BETA, GRADIENT_SCORE, LINEAR_MODEL, LOSS_SCORE
from .trainer import DPTrainer, ImagesAndLabels

SCORE_CHUNK = 256  # canaries scored at once
Parameters = dict[str, torch.Tensor]
# (trained model, its parameters before training, normalized canary images, labels) -> score per canary, higher
# meaning "more likely included"
ScoreFn = Callable[[nn.Module, Parameters, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AuditResult:
    """One audit: the empirical lower bound beside the accountant's epsilon for the same run."""

    epsilon_lower_bound: float
    accountant_epsilon: float
    delta: float
    confidence: float  # 1 - beta: the lower bound is wrong with probability at most beta
    num_canaries: int
    num_included: int  # canaries that were in the training set
    guesses_included: int  # k+: canaries guessed "included" (the highest scores)
    guesses_excluded: int  # k-: canaries guessed "excluded" (the lowest scores)
    correct_guesses: int
    largest_possible_bound: float  # the lower bound had every guess been right: the most these guesses can show
    score: str
    noise_multiplier: float
    steps: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_canaries(image_shape: tuple[int, ...], num_classes: int, count: int, seed: int) -> ImagesAndLabels:
    """`count` uint8 images of uniform random pixels with uniform random labels."""
    if count < 2 or num_classes < 2:
        raise ParameterError(f"an audit needs at least 2 canaries and 2 classes, got {count} and {num_classes}")
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (count, *image_shape), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, num_classes, (count,), generator=generator)
    return images, labels


def _example_gradients(model: nn.Module, params: Parameters, images: torch.Tensor, labels: torch.Tensor) -> Parameters:
    buffers = dict(model.named_buffers())

    def loss(p: Parameters, image: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, (p, buffers), (image[None],)), label[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, images, labels)


def _chunked(score: ScoreFn) -> ScoreFn:
    """`score` over SCORE_CHUNK canaries at a time (per-canary gradients of all m at once may not fit memory)."""

    def chunked(model: nn.Module, initial: Parameters, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [
                score(model, initial, images[start : start + SCORE_CHUNK], labels[start : start + SCORE_CHUNK])
                for start in range(0, len(images), SCORE_CHUNK)
            ]
        )

    return chunked


def gradient_alignment_score(
    model: nn.Module, initial: Parameters, images: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """White-box: how far training moved the weights along each canary's own descent direction.

    <theta_T - theta_0, -g_i> / |g_i|, with g_i the canary's gradient at the initial weights: an
    included canary pushed the weights that way every step it was sampled.
    """
    gradients = _example_gradients(model, initial, images, labels)
    moved = {name: param.detach() - initial[name] for name, param in model.named_parameters()}
    dots = sum((-g.flatten(1) * moved[name].flatten()).sum(1) for name, g in gradients.items())
    norms = per_sample_norms(gradients)
    return dots / norms.clamp_min(1e-12)


def negative_loss_score(
    model: nn.Module, initial: Parameters, images: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Black-box: minus the trained model's loss on each canary (included canaries were fitted)."""
    with torch.no_grad():
        return -F.cross_entropy(model(images), labels, reduction="none")


SCORES: dict[str, ScoreFn] = {
    GRADIENT_SCORE: _chunked(gradient_alignment_score),
    LOSS_SCORE: _chunked(negative_loss_score),
}


def _linear(shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(shape[0] * shape[1] * shape[2], num_classes))


def _cnn(shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(shape[0], 16, 3, padding=1),
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(16 * 16, num_classes),
    )


def _canonicalized_cnn(shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """The small CNN behind a C4 canonicaliser: an audit of the adapted models' training (square images only)."""
    return canonicalize(_cnn(shape, num_classes), "C4", in_channels=shape[0])


# the small models `equiconvert audit` trains: (image shape C, H, W; classes) -> untrained model
SMALL_MODELS: dict[str, Callable[[tuple[int, int, int], int], nn.Module]] = {
    LINEAR_MODEL: _linear,
    CNN_MODEL: _cnn,
    CANONICALIZED_MODEL: _canonicalized_cnn,
}


def _check_guesses(guesses_included: int, guesses_excluded: int, num_canaries: int) -> None:
    if guesses_included < 0 or guesses_excluded < 0 or guesses_included + guesses_excluded > num_canaries:
        raise ParameterError(
            f"k+ ({guesses_included}) and k- ({guesses_excluded}) must be >= 0 and together at most "
            f"the number of canaries ({num_canaries})"
        )


def count_correct(scores: torch.Tensor, included: torch.Tensor, guesses_included: int, guesses_excluded: int) -> int:
    """Right guesses when the k+ highest scores are called included and the k- lowest excluded."""
    _check_guesses(guesses_included, guesses_excluded, len(scores))
    order = torch.argsort(scores, descending=True)
    top, bottom = order[:guesses_included], order[len(order) - guesses_excluded :]
    return int(included[top].sum()) + int((~included[bottom]).sum())


def run_audit(
    model: nn.Module,
    train_set: ImagesAndLabels,
    canaries: ImagesAndLabels,
    *,
    guesses_included: int,
    guesses_excluded: int,
    score: str = "gradient",
    beta: float = DEFAULT_BETA,
    inclusion_seed: int = 0,
    trainer_class: type[DPTrainer] = DPTrainer,
    device: str | torch.device | None = None,
    **options: Any,
) -> AuditResult:
    """Train `model` (untrained) once on `train_set` plus a random half of `canaries` and audit the run.

    `options` are DPConfig fields (target_epsilon, delta, steps, seed, ...) for the trainer;
    `inclusion_seed` draws which canaries are included. Nothing is written to disk.
    """
    if score not in SCORES:
        raise ParameterError(f"unknown audit score {score!r}; known: {', '.join(SCORES)}")
    if not 0.0 < beta < 1.0:
        raise ParameterError(f"beta (1 - confidence) must lie in (0, 1), got {beta}")
    images, labels = _tensors(train_set)
    canary_images, canary_labels = _tensors(canaries)
    if canary_images.shape[1:] != images.shape[1:] or canary_images.dtype != images.dtype:
        raise ParameterError(
            f"canaries must match the training images' shape and dtype: {tuple(canary_images.shape[1:])} "
            f"{canary_images.dtype} vs {tuple(images.shape[1:])} {images.dtype}"
        )
    coins = np.random.default_rng(inclusion_seed).integers(0, 2, size=len(canary_images)).astype(bool)
    included = torch.from_numpy(coins)
    _check_guesses(guesses_included, guesses_excluded, len(included))

    trainer = trainer_class(model, device=device, progress=False, **options)
    initial = {name: param.detach().clone() for name, param in trainer.model.named_parameters()}
    trainer.fit((torch.cat([images, canary_images[included]]), torch.cat([labels, canary_labels[included]])))

    trainer.model.eval()
    normalized = trainer._normalize(canary_images)  # the trainer's own preprocessing
    scores = SCORES[score](trainer.model, initial, normalized, canary_labels.to(trainer.device)).cpu()
    correct = count_correct(scores, included, guesses_included, guesses_excluded)
    delta = trainer.delta  # the run's delta (the configured one, or the default for its data set size)
    guesses = guesses_included + guesses_excluded
    return AuditResult(
        epsilon_lower_bound=epsilon_lower_bound(correct, guesses, len(included), delta, beta),
        largest_possible_bound=epsilon_lower_bound(guesses, guesses, len(included), delta, beta),
        accountant_epsilon=trainer.epsilon,
        delta=delta,
        confidence=1.0 - beta,
        num_canaries=len(included),
        num_included=int(included.sum()),
        guesses_included=guesses_included,
        guesses_excluded=guesses_excluded,
        correct_guesses=correct,
        score=score,
        noise_multiplier=float(trainer.noise_multiplier),
        steps=trainer.step,
    )


def _tensors(data: ImagesAndLabels | Any) -> ImagesAndLabels:
    """(images, labels) of tensors or a TensorDataset (the audit's canary sets)."""
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0], data[1]
    if hasattr(data, "tensors") and len(data.tensors) == 2:  # torch.utils.data.TensorDataset
        return data.tensors
    raise ParameterTypeError("training data must be (images, labels) tensors or a TensorDataset of them")
