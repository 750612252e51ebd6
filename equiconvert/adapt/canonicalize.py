"""Invariance for a model that keeps its trained weights: canonicalise the input's pose first.

`canonicalize(model, group)` puts a small canonicalisation network in front of `model`. That network is a plain
CNN converted by `make_equivariant`, so its output is a regular field: one score per group element, and turning
the input by g permutes the scores by g. Each image is turned back by the inverse of its best-scoring element
before `model` sees it; an input turned by g then reaches `model` in exactly the same pose, so the whole model
is invariant to every element of the group that acts on the pixel grid exactly (rotations by 90 degrees and
flips, done by torch.rot90 and torch.flip). Other turns (45 degrees in C8 and D8) are undone by bilinear
interpolation and the canonicaliser's filters are only approximately equivariant to them, so invariance to
those is approximate; check_equivariance measures it. `model` itself is kept as it is: the same module and
parameter objects, untouched.

The choice of pose is discrete. The forward takes the hard one-hot choice (the chosen pose, unblended, so the
grid elements stay exact); the backward takes the gradient of the softmax of the scores (a straight-through
estimator), so the canonicaliser learns from the task loss. Under DP-SGD this is sound whatever the estimator:
every operation here (the interpolated turns included) acts on one example alone, so each example's gradient
of every trained parameter (canonicaliser and backbone) is a function of that example only; DP-SGD clips that
whole gradient jointly and adds noise, so the sensitivity bound holds for whatever vector the estimator
produces. The estimator affects the quality of the update, never the privacy.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..convert import EquivariantModel, make_equivariant
from ..errors import CallOrderError, GroupSpecError, UsageError
from ..group_names import MAX_ORDER
from ..groups import GroupSpec, parse_group
from ..build_recipe import CANONICALIZE, recipe_of, remember_recipe

IDENTITY = 0  # index of the identity element among GroupSpec.elements ((flip 0, rotation 0) comes first)
PerExampleLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class CanonicalizationError(UsageError, ValueError):
    """canonicalize was given a model, number or input it cannot make invariant."""


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


def pose_scores(canonicalizer: nn.Module, x: torch.Tensor, order: int, reach: int | None = None) -> torch.Tensor:
    """(B, order) scores: the canonicaliser's regular fields averaged over fields and positions.

    An average of regular fields is a regular field, so the scores permute with the input's pose. With `reach`
    (groups with turns off the pixel grid) only the positions of the field's inscribed disc shrunk by `reach`
    count: their receptive fields lie in the image's inscribed disc, which every turn keeps inside the image, so
    the corners that a 45-degree turn cuts off and fills with zeros leave the scores as they are."""
    fields = canonicalizer(x).unflatten(1, (-1, order))
    if reach is None:
        return fields.mean(dim=(1, 3, 4))
    weights = inner_disc(fields.shape[-1], reach, fields)
    return (fields * weights).sum(dim=(3, 4)).mean(dim=1) / weights.sum()


def inner_disc(size: int, reach: int, like: torch.Tensor) -> torch.Tensor:
    """(size, size) mask of the positions at least `reach` inside the inscribed disc of a size x size grid."""
    coords = torch.arange(size, dtype=like.dtype, device=like.device) - (size - 1) / 2
    return ((coords[:, None] ** 2 + coords[None, :] ** 2).sqrt() <= size / 2 - reach).to(like.dtype)


def straight_through_choice(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """Forward: the one-hot of the argmax, exactly. Backward: the gradient of softmax(scores / temperature).

    `hard + (soft - soft.detach())` adds an exact zero to the one-hot in the forward (unlike `hard - soft.detach()
    + soft`, whose rounding can leave 1 - 1e-8), so the chosen pose is passed on bit for bit."""
    soft = torch.softmax(scores / temperature, dim=-1)
    best = scores.argmax(dim=-1, keepdim=True)
    hard = (torch.arange(scores.shape[-1], device=scores.device) == best).to(scores.dtype)
    return hard + (soft - soft.detach())


@dataclass(frozen=True)
class Pose:
    """A group element as the canonicaliser undoes it: an optional horizontal flip, then a counter-clockwise
    turn (rot90's sense) by `quarter_turns` quarter turns plus `residual` radians.

    The residual lies in [-pi/4, pi/4] and is 0 exactly for elements that map the pixel grid onto itself, which
    are then done by torch.rot90 and torch.flip alone (bit-exact); any other turn interpolates the residual."""

    name: str
    quarter_turns: int
    residual: float
    flip: bool

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """x acted on by this element."""
        x = torch.flip(x, dims=[-1]) if self.flip else x
        return turn(torch.rot90(x, self.quarter_turns, dims=(-2, -1)), self.residual)

    def undo(self, x: torch.Tensor) -> torch.Tensor:
        """x acted on by the inverse of this element."""
        x = torch.rot90(turn(x, -self.residual), -self.quarter_turns, dims=(-2, -1))
        return torch.flip(x, dims=[-1]) if self.flip else x


def group_poses(group: GroupSpec) -> tuple[Pose, ...]:
    """The poses of `group` in the order of its regular field's channels (GroupSpec.elements)."""
    poses = []
    for flip, rotation in group.elements:
        quarter_turns = round(4 * rotation / group.n)  # the nearest quarter turn, so the residual is smallest
        residual = 2 * math.pi * rotation / group.n - quarter_turns * math.pi / 2 if 4 * rotation % group.n else 0.0
        name = f"rot{360 * rotation / group.n:g}" + ("+flip" if flip else "")
        poses.append(Pose(name, quarter_turns % 4, residual, bool(flip)))
    return tuple(poses)


def turn(x: torch.Tensor, angle: float) -> torch.Tensor:
    """x turned by `angle` radians (rot90's sense) about its centre: bilinear, zeros outside; x itself for 0."""
    if angle == 0.0:
        return x
    c, s = math.cos(angle), math.sin(angle)
    theta = torch.tensor([[[c, -s, 0.0], [s, c, 0.0]]], dtype=x.dtype, device=x.device)
    grid = F.affine_grid(theta, [1, 1, x.shape[-2], x.shape[-1]], align_corners=False)
    return F.grid_sample(x, grid.expand(x.shape[0], -1, -1, -1), mode="bilinear", align_corners=False)


def canonical_pose(x: torch.Tensor, choice: torch.Tensor, poses: tuple[Pose, ...]) -> torch.Tensor:
    """Each image turned back by the inverse of its chosen element: the choice-weighted sum of all poses.

    With a one-hot choice the sum is the chosen pose plus exact zeros, so the result is that pose exactly."""
    turned = torch.stack([pose.undo(x) for pose in poses], dim=1)  # (B, order, C, H, W)
    return (choice[:, :, None, None, None] * turned).sum(dim=1)


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
    """`backbone` behind a canonicaliser: invariant to `group` (exactly on the pixel grid); see the module docstring.

    Built by `canonicalize`, which checks its arguments.

    Args:
        backbone: the model that sees each image turned back to its canonical pose.
        canonicalizer: the equivariant network scoring each pose (one output per group element).
        group: the group whose poses are scored.
        temperature: of the softmax whose gradient the straight-through estimator takes.
        pool: the average pooling of the canonicaliser's input (1: none).
        reach: the canonicaliser's receptive-field radius, for a group with turns off the pixel grid (see
            pose_scores); None for a group acting on the grid, whose scores average every position.
    """

    def __init__(
        self,
        backbone: nn.Module,
        canonicalizer: EquivariantModel,
        group: GroupSpec,
        temperature: float,
        pool: int,
        reach: int | None = None,
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.canonicalizer = canonicalizer
        self.group = group
        self.in_channels = canonicalizer.in_channels
        self.temperature = temperature
        self.pool = pool
        self.reach = reach
        self.elements = group_poses(group)
        self.keep_scores = False  # set by pose_prior_loss: forwards then leave their scores for it
        self._slot = _ScoreSlot()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        scores = pose_scores(self.canonicalizer, x, self.group.order, self.reach)
        if self.keep_scores:
            self._slot.scores = scores
        choice = straight_through_choice(scores, self.temperature)
        return self.backbone(canonical_pose(x, choice, self.elements))

    @property
    def off_grid_angles(self) -> tuple[float, ...]:
        """The group's turns (degrees) that do not map the pixel grid onto itself: where invariance is approximate."""
        n = self.group.n
        return tuple(360 * j / n for j in range(n) if 4 * j % n)

    def poses(self, x: torch.Tensor) -> list[str]:
        """The name of the element each image is turned back from (for inspection)."""
        self._check_input(x)
        with torch.no_grad():
            best = pose_scores(self.canonicalizer, x, self.group.order, self.reach).argmax(dim=-1)
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
        if self.reach is not None and x.shape[-1] // self.pool <= 2 * self.reach:
            raise CanonicalizationError(
                f"image size {x.shape[-1]} is too small for {self.group.name}: the canonicaliser scores the "
                f"positions {self.reach} pixels inside the inscribed disc of its {x.shape[-1] // self.pool}-pixel "
                "input; pass larger images, a smaller pool or a smaller kernel_size"
            )


def _discrete_group(group: str | GroupSpec) -> GroupSpec:
    """C_N or D_N: SO2/O2 are refused, their poses being a continuum that a choice among scores cannot cover."""
    spec = parse_group(group)
    if not isinstance(spec, GroupSpec):
        raise GroupSpecError(
            f"canonicalize: group {spec.name!r} is continuous, and the canonicaliser chooses among finitely many "
            f"poses; use {'D' if spec.kind == 'O2' else 'C'}{MAX_ORDER}, whose turns are {360 / MAX_ORDER:g} degrees "
            "apart, for an approximately invariant model"
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
    """`model` (kept as it is, same objects) behind an equivariant canonicaliser: invariant to `group`.

    Exactly invariant to the elements that act on the pixel grid (all of C1, C2, C4, D1, D2, D4; the quarter
    turns and flips of C8, D8, ...); approximately to the other turns, which are undone by bilinear interpolation
    (check_equivariance(wrapped, images=...) measures the error; the canonicaliser then scores only the
    positions inside the image's inscribed disc, see pose_scores). SO2/O2 are refused: the canonicaliser chooses
    one of finitely many poses by the straight-through estimator, and a continuous angle would need another
    estimator while C16/D16 (22.5 degrees apart) already leave an error set by interpolation.

    The canonicaliser is PoseScoreCNN(in_channels, |G|, fields, kernel_size, pool) converted by make_equivariant:
    `fields` regular fields, a kernel_size stem; `pool` > 1 average-pools its input first (cheaper; the image
    size must then be a multiple of pool). Inputs must be square. Add pose_prior_loss to the loss to keep
    upright data in the identity pose. The recipe of a model built by create_model is kept, so
    equiconvert.save/load rebuild it.

    Args:
        model: the model to make invariant.
        group: the group name or spec: C1..C16 or D1..D16.
        in_channels: the input channels.
        fields: the canonicaliser's regular fields.
        kernel_size: the canonicaliser's odd stem kernel size.
        pool: average pooling of the canonicaliser's input (1: none).
        temperature: of the straight-through softmax; > 0.

    Returns:
        The wrapped model; `model` itself is its backbone.

    Raises:
        CanonicalizationError: `model` is not a Module, or a number out of range.
        GroupSpecError: SO2 or O2 (use C16 or D16).
    """
    if not isinstance(model, nn.Module):
        raise CanonicalizationError(f"canonicalize: model must be a torch.nn.Module, got {type(model).__name__}")
    spec = _discrete_group(group)
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
    off_grid = len(spec.grid_elements) < spec.order
    reach = kernel_size // 2 + 1 if off_grid else None  # the stem's radius and the 3x3 conv's
    wrapped = CanonicalizedModel(model, canonicalizer, spec, float(temperature), pool, reach)
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
