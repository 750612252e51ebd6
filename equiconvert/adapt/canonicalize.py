"""Exact invariance for a model that keeps its trained weights: canonicalise the input's pose first.

`canonicalize(model, group)` puts a small canonicalisation network in front of `model`. That network is a plain
CNN converted by `make_equivariant`, so its output is a regular field: one score per group element, and turning
the input by g permutes the scores by g. Each image is turned back by the inverse of its best-scoring element
before `model` sees it; an input turned by g then reaches `model` in exactly the same pose, so the whole model
is invariant to every element of the group (rotations by 90 degrees and flips act on the pixel grid exactly).
`model` itself is kept as it is: the same module and parameter objects, untouched.

The choice of pose is discrete. The forward takes the hard one-hot choice (so invariance is exact); the
backward takes the gradient of the softmax of the scores (a straight-through estimator), so the canonicaliser
learns from the task loss. Under DP-SGD this is sound whatever the estimator: every operation here acts on one
example alone, so each example's gradient of every trained parameter (canonicaliser and backbone) is a function
of that example only; DP-SGD clips that whole gradient jointly and adds noise, so the sensitivity bound holds
for whatever vector the estimator produces. The estimator affects the quality of the update, never the privacy.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..convert import EquivariantModel, make_equivariant
from ..errors import CallOrderError, GroupSpecError, UsageError
from ..groups import GridElement, GroupSpec, parse_group
from ..build_recipe import CANONICALIZE, recipe_of, remember_recipe

IDENTITY = 0  # index of the identity element among GroupSpec.elements ((flip 0, rotation 0) comes first)
PerExampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class CanonicalizationError(UsageError, ValueError):
    """canonicalize was asked for something it cannot make exactly invariant."""


class PoseScoreCNN(nn.Module):
    """The plain CNN that make_equivariant turns into the canonicaliser.

    An optional average pool (cost), a kernel x kernel stem and a residual 3x3 conv, every conv with
    `fields * order` channels: converted with width="channels" these are `fields` regular fields. The residual
    add keeps the last conv a hidden layer (regular output, not the trivial fields of a classifier conv). The
    last conv has no bias: a field's bias adds one constant to every score, which no choice or softmax sees.
    """

    def __init__(self, in_channels: int, order: int, fields: int, kernel_size: int, pool: int) -> None:
        super().__init__()
        channels = fields * order
        self.pool = nn.AvgPool2d(pool) if pool > 1 else nn.Identity()
        self.stem = nn.Conv2d(in_channels, channels, kernel_size, padding=kernel_size // 2)
        self.mix = nn.Conv2d(channels, channels, 3, padding=1, bias=False)  # a field's bias shifts all its scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(self.pool(x)))
        return h + self.mix(h)


def pose_scores(canonicalizer: nn.Module, x: torch.Tensor, order: int) -> torch.Tensor:
    """(B, order) scores: the canonicaliser's regular fields averaged over fields and positions.

    An average of regular fields is a regular field, so the scores permute with the input's pose."""
    fields = canonicalizer(x)
    return fields.unflatten(1, (-1, order)).mean(dim=(1, 3, 4))


def straight_through_choice(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """Forward: the one-hot of the argmax, exactly. Backward: the gradient of softmax(scores / temperature).

    `hard + (soft - soft.detach())` adds an exact zero to the one-hot in the forward (unlike `hard - soft.detach()
    + soft`, whose rounding can leave 1 - 1e-8), so the chosen pose is passed on bit for bit."""
    soft = torch.softmax(scores / temperature, dim=-1)
    best = scores.argmax(dim=-1, keepdim=True)
    hard = (torch.arange(scores.shape[-1], device=scores.device) == best).to(scores.dtype)
    return hard + (soft - soft.detach())


def undo(element: GridElement, x: torch.Tensor) -> torch.Tensor:
    """x acted on by the inverse of `element` (which flips, then turns)."""
    x = torch.rot90(x, -element.quarter_turns, dims=(-2, -1))
    return torch.flip(x, dims=[-1]) if element.flip else x


def canonical_pose(x: torch.Tensor, choice: torch.Tensor, elements: tuple[GridElement, ...]) -> torch.Tensor:
    """Each image turned back by the inverse of its chosen element: the choice-weighted sum of all poses.

    With a one-hot choice the sum is the chosen pose plus exact zeros, so the result is that pose exactly."""
    poses = torch.stack([undo(element, x) for element in elements], dim=1)  # (B, order, C, H, W)
    return (choice[:, :, None, None, None] * poses).sum(dim=1)


class _ScoreSlot:
    """The pose scores of the last forward, for pose_prior_loss; never saved or pickled.

    Copies of the model share it (DP-SGD's probes run on copies): the loss reads the scores of whichever copy
    ran the forward it follows."""

    def __init__(self) -> None:
        self.scores: torch.Tensor | None = None

    def __deepcopy__(self, memo: dict) -> "_ScoreSlot":
        return self

    def __getstate__(self) -> dict:
        return {"scores": None}


class CanonicalizedModel(nn.Module):
    """`backbone` behind a canonicaliser: exactly invariant to `group`; see the module docstring.

    Built by `canonicalize`, which checks its arguments.

    Args:
        backbone: the model that sees each image turned back to its canonical pose.
        canonicalizer: the equivariant network scoring each pose (one output per group element).
        group: the group whose poses are scored.
        temperature: of the softmax whose gradient the straight-through estimator takes.
        pool: the average pooling of the canonicaliser's input (1: none).
    """

    def __init__(
        self, backbone: nn.Module, canonicalizer: EquivariantModel, group: GroupSpec, temperature: float, pool: int
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.canonicalizer = canonicalizer
        self.group = group
        self.in_channels = canonicalizer.in_channels
        self.temperature = temperature
        self.pool = pool
        self.elements = group.grid_elements
        self.keep_scores = False  # set by pose_prior_loss: forwards then leave their scores for it
        self._slot = _ScoreSlot()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        scores = pose_scores(self.canonicalizer, x, self.group.order)
        if self.keep_scores:
            self._slot.scores = scores
        choice = straight_through_choice(scores, self.temperature)
        return self.backbone(canonical_pose(x, choice, self.elements))

    def poses(self, x: torch.Tensor) -> list[str]:
        """The name of the element each image is turned back from (for inspection)."""
        self._check_input(x)
        with torch.no_grad():
            best = pose_scores(self.canonicalizer, x, self.group.order).argmax(dim=-1)
        return [self.elements[int(i)].name for i in best]

    def take_scores(self) -> torch.Tensor:
        """The scores the last forward left, removed from the model."""
        scores, self._slot.scores = self._slot.scores, None
        if scores is None:
            raise CallOrderError("no pose scores: call the loss right after a forward of the model")
        return scores

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[-1] != x.shape[-2] or x.shape[1] != self.in_channels:
            raise CanonicalizationError(
                f"a canonicalized model takes square images (B, {self.in_channels}, S, S), got {tuple(x.shape)}: "
                "a quarter turn of a non-square image changes its shape"
            )
        if x.shape[-1] % self.pool:
            raise CanonicalizationError(
                f"image size {x.shape[-1]} is not a multiple of pool={self.pool}: the canonicaliser's pooling "
                "would not be exactly equivariant; resize the images or pass another pool"
            )


def _grid_group(group: str | GroupSpec) -> GroupSpec:
    spec = parse_group(group)
    if not isinstance(spec, GroupSpec) or len(spec.grid_elements) != spec.order:
        name = getattr(spec, "name", group)
        raise GroupSpecError(
            f"canonicalize: group {name!r} has elements that do not map the pixel grid onto itself, so the pose "
            "could not be undone exactly; use C1, C2, C4, D1, D2 or D4"
        )
    return spec


def canonicalize(
    model: nn.Module,
    group: str | GroupSpec = "D4",
    *,
    in_channels: int = 3,
    fields: int = 2,
    kernel_size: int = 5,
    pool: int = 1,
    temperature: float = 1.0,
) -> CanonicalizedModel:
    """`model` (kept as it is, same objects) behind an equivariant canonicaliser: exactly invariant to `group`.

    group: one whose every element acts on the pixel grid (C1, C2, C4, D1, D2, D4); C8, D8 and SO2/O2 are
    refused. The canonicaliser is PoseScoreCNN(in_channels, |G|, fields, kernel_size, pool) converted by
    make_equivariant: `fields` regular fields, a kernel_size stem; `pool` > 1 average-pools its input first
    (cheaper; the image size must then be a multiple of pool). temperature: of the softmax whose gradient the
    straight-through estimator takes. Inputs must be square. Add pose_prior_loss to the loss to keep upright
    data in the identity pose. The recipe of a model built by create_model is kept, so equiconvert.save/load
    rebuild it.

    Args:
        model: the model to make invariant.
        group: the group name or spec.
        in_channels: the input channels.
        fields: the canonicaliser's regular fields.
        kernel_size: the canonicaliser's odd stem kernel size.
        pool: average pooling of the canonicaliser's input (1: none).
        temperature: of the straight-through softmax; > 0.

    Returns:
        The wrapped model; `model` itself is its backbone.

    Raises:
        CanonicalizationError: `model` is not a Module, or a number out of range.
        GroupSpecError: a group with an element that does not act on the pixel grid.
    """
    if not isinstance(model, nn.Module):
        raise CanonicalizationError(f"canonicalize: model must be a torch.nn.Module, got {type(model).__name__}")
    spec = _grid_group(group)
    for name, value in (("in_channels", in_channels), ("fields", fields), ("kernel_size", kernel_size), ("pool", pool)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CanonicalizationError(f"canonicalize: {name} must be an int >= 1, got {value!r}")
    if kernel_size % 2 == 0:
        raise CanonicalizationError(f"canonicalize: kernel_size must be odd (a centred filter), got {kernel_size}")
    if not temperature > 0:
        raise CanonicalizationError(f"canonicalize: temperature must be > 0, got {temperature!r}")
    plain = PoseScoreCNN(in_channels, spec.order, fields, kernel_size, pool)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report's "output NOT invariant": a regular output is the point here
        canonicalizer = make_equivariant(plain, spec, width="channels")
    wrapped = CanonicalizedModel(model, canonicalizer, spec, float(temperature), pool)
    arguments = {
        "group": spec.name,
        "in_channels": in_channels,
        "fields": fields,
        "kernel_size": kernel_size,
        "pool": pool,
        "temperature": float(temperature),
    }
    built = recipe_of(model)
    return remember_recipe(wrapped, None if built is None else {**copy.deepcopy(built), CANONICALIZE: arguments})


def identity_pose_loss(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per view, the cross-entropy of the softmax of its pose scores against the identity element (the prior)."""
    return -torch.log_softmax(scores / temperature, dim=-1)[..., IDENTITY]


def pose_prior_loss(model: nn.Module, weight: float = 1.0, loss_fn: PerExampleLoss | None = None) -> PerExampleLoss:
    """A per-example loss: loss_fn (default cross-entropy) plus `weight` times the pose prior.

    The prior is each view's cross-entropy of the softmax of its pose scores against the identity element:
    training on upright data then keeps upright images in the identity pose (the backbone sees them as it was
    trained). It reads the scores the model's forward just computed (no second forward), so call it
    right after each forward; it works inside DPTrainer (vmap and book-keeping) and after make_private.

    Args:
        model: a model containing a CanonicalizedModel; its forwards then keep their pose scores for the loss.
        weight: the weight of the pose prior; >= 0.
        loss_fn: the per-example loss (logits, labels) -> (N,); None for cross-entropy.

    Returns:
        The per-example loss (logits, labels) -> (N,).

    Raises:
        CanonicalizationError: no CanonicalizedModel in `model`, or a negative weight.
    """
    target = next((m for m in model.modules() if isinstance(m, CanonicalizedModel)), None)
    if target is None:
        raise CanonicalizationError("pose_prior_loss: model contains no CanonicalizedModel (see canonicalize)")
    if not weight >= 0:
        raise CanonicalizationError(f"pose_prior_loss: weight must be >= 0, got {weight!r}")
    target.keep_scores = True
    base = loss_fn or (lambda logits, labels: F.cross_entropy(logits, labels, reduction="none"))

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return base(logits, labels) + weight * identity_pose_loss(target.take_scores(), target.temperature)

    return loss
