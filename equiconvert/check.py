"""Measure how equivariant a model is: exact grid elements, and optionally other angles."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .adapt.canonicalize import CanonicalizedModel
from .errors import ParameterError
from .convert.core import GRID_SEARCH
from .convert.fields import FieldType
from .convert.model import EquivariantModel
from .convert.report import ConversionReport
from .groups import GridElement, GroupSpec, parse_group
from .progress import progress_bar, require_progress


@dataclass
class EquivarianceResult:
    """Max relative output error per group element (and per extra angle, if asked)."""

    errors: dict[str, float]
    angle_errors: dict[float, float] = field(default_factory=dict)

    @property
    def max_error(self) -> float:
        return max(self.errors.values())


def act_on_output(element: GridElement, y: torch.Tensor, output_type: FieldType | None) -> torch.Tensor:
    """How `element` transforms an output of type `output_type` (feature map or vector)."""
    if output_type is not None and not output_type.is_invariant and hasattr(output_type.group, "grid_matrix"):
        matrix = output_type.group.grid_matrix(output_type.representation, element).to(y.device, y.dtype)
        fields = y.unflatten(1, (output_type.num_fields, output_type.field_size))
        y = torch.einsum("ij,bfj...->bfi...", matrix, fields).flatten(1, 2)
    elif output_type is not None and not output_type.is_invariant:
        size = output_type.field_size
        inverse = torch.argsort(torch.tensor(element.regular_perm, device=y.device))
        fields = y.reshape(y.shape[0], output_type.num_fields, size, *y.shape[2:])
        y = fields[:, :, inverse].reshape(y.shape)
    return element.act_on_grid(y) if y.ndim == 4 else y


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _disk(size: int) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    radius = torch.sqrt(coords[:, None] ** 2 + coords[None, :] ** 2)
    return (radius <= (size - 1) / 2).float()


def _image_shape(images: torch.Tensor, input_size: int | None, in_channels: int | None) -> tuple[int, int]:
    """The (input_size, in_channels) of a batch of square images, refused where it contradicts those given."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[-1] != images.shape[-2]:
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ParameterError(f"check_equivariance: images must be a (B, C, S, S) tensor, got {got}")
    size, channels = images.shape[-1], images.shape[1]
    for name, given, actual in (("input_size", input_size, size), ("in_channels", in_channels, channels)):
        if given is not None and given != actual:
            raise ParameterError(
                f"check_equivariance: {name}={given} contradicts images of shape {tuple(images.shape)}"
            )
    return size, channels


def _require_positive(name: str, value: object) -> None:
    """Refuse a size or count that is not an int >= 1 (0 would otherwise mean "the default", < 0 a torch error)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ParameterError(f"check_equivariance: {name} must be an int >= 1, got {value!r}")


def _warn_if_not_exact(report: ConversionReport, size: int) -> None:
    """Warn when `size` is one the grid analysis found not to keep exact equivariance: the error measured there
    mixes the model's equivariance with the grid's misalignment."""
    valid = report.valid_input_sizes
    searched = report.input_fit is not None or GRID_SEARCH[0] <= size <= GRID_SEARCH[-1]
    if size in valid or not searched:
        return
    below = [s for s in valid if s < size][-1:]
    above = [s for s in valid if s > size][:1]
    nearest = ", ".join(map(str, below + above)) or "none"
    warnings.warn(
        f"check_equivariance: input size {size} does not keep exact equivariance for this model (valid: "
        f"{report.valid_input_rule or 'none'}; nearest: {nearest}), so the measured error is not a statement about "
        "exact equivariance; pass input_size= one of the nearest valid sizes",
        UserWarning,
        stacklevel=3,
    )


def check_equivariance(
    model: nn.Module,
    group: str | GroupSpec | None = None,
    input_size: int | None = None,
    *,
    in_channels: int | None = None,
    batch_size: int = 2,
    angles: tuple[float, ...] | None = None,
    images: torch.Tensor | None = None,
    seed: int = 0,
    progress: bool | None = None,
) -> EquivarianceResult:
    """Compare model(g.x) with g.model(x) for every element g acting exactly on the pixel grid.

    For an EquivariantModel, group, input size and channels default to its own; for a CanonicalizedModel
    (adapt.canonicalize), group and channels do, the output is compared as invariant, and `angles` default to
    the group's turns off the pixel grid (45, 135, 225 and 315 degrees for C8). `angles` (degrees) adds the error
    of invariant outputs under rotations of the inputs masked to their inscribed disc (so no content leaves the
    image or enters at the corners), by bilinear interpolation: these errors are not at float precision, and on
    random normal images they mostly measure what interpolation loses of white noise; pass real (smooth) images
    for a realistic figure.

    Args:
        model: the model to check.
        group: the group; None for the model's own (EquivariantModel, CanonicalizedModel).
        input_size: the square image size; None for an EquivariantModel's own.
        in_channels: the input channels; None for the model's own.
        batch_size: random images per check.
        angles: rotations (degrees) for the off-grid error of invariant outputs; None for a CanonicalizedModel's
            turns off the pixel grid, none for other models.
        images: (B, C, S, S) images to check on, e.g. a batch of data; None for batch_size random normal images.
        seed: the seed of the random images.
        progress: a bar on stderr per element and angle checked, for a check longer than progress.DELAY_S; None
            shows it only when stderr is a terminal.

    Returns:
        The largest error per group element (and per angle).

    Raises:
        ParameterError: a size, channel count or batch size below 1, group/input_size/in_channels missing for a
            model equiconvert did not convert, images that are not (B, C, S, S) or disagree with input_size or
            in_channels, or angles for an output that is not (batch, classes).
    """
    require_progress("check_equivariance", progress)
    for name, value in (("input_size", input_size), ("in_channels", in_channels), ("batch_size", batch_size)):
        _require_positive(name, value)
    if images is not None:
        input_size, in_channels = _image_shape(images, input_size, in_channels)
    output_type = None
    if isinstance(model, EquivariantModel):
        # a restricted model is equivariant to the subgroup its output fields live in
        group = group or (model.output_type.group if model.output_type is not None else model.group)
        input_size = model.default_input_size() if input_size is None else input_size
        in_channels = model.in_channels if in_channels is None else in_channels
        output_type = model.output_type
    if isinstance(model, CanonicalizedModel):  # invariant: output_type None compares the outputs as they are
        group = group or model.group
        in_channels = model.in_channels if in_channels is None else in_channels
        angles = model.off_grid_angles if angles is None else angles
    angles = () if angles is None else angles
    if group is None or input_size is None or in_channels is None:
        raise ParameterError("pass group, input_size and in_channels for a model that equiconvert did not convert")
    report = getattr(model, "report", None)
    if isinstance(report, ConversionReport):
        _warn_if_not_exact(report, input_size)
    spec = parse_group(group)
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    generator = torch.Generator().manual_seed(seed)
    dtype = parameter.dtype if parameter is not None and parameter.is_floating_point() else None
    x = torch.randn(batch_size, in_channels, input_size, input_size, generator=generator) if images is None else images
    x = x.to(device, dtype)
    was_training = model.training
    model.eval()
    bar = progress_bar("equivariance check", "element", progress, total=len(spec.grid_elements) + len(angles))
    try:
        with torch.no_grad(), bar:
            y = model(x)
            errors = {}
            for g in spec.grid_elements:
                errors[g.name] = _relative(model(g.act_on_grid(x)), act_on_output(g, y, output_type))
                bar.update(1)
            angle_errors = _angle_errors(model, x, angles, bar) if angles else {}
    finally:
        model.train(was_training)
    return EquivarianceResult(errors, angle_errors)


def _angle_errors(model: nn.Module, x: torch.Tensor, angles: tuple[float, ...], bar: Any) -> dict[float, float]:
    from torchvision.transforms.functional import InterpolationMode, rotate

    masked = x * _disk(x.shape[-1]).to(x.device)
    reference = model(masked)
    if reference.ndim != 2:
        raise ParameterError("angle errors are defined for invariant (batch, classes) outputs only")
    errors = {}
    for angle in angles:
        errors[float(angle)] = _relative(model(rotate(masked, angle, InterpolationMode.BILINEAR)), reference)
        bar.update(1)
    return errors
