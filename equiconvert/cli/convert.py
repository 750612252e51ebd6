"""`equiconvert convert`: build a registry model, convert it, check its equivariance and print the report."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

from ..conversion_options import DEFAULT_MODE, DEFAULT_WIDTH, HEADS, MODES, PAPER_KAPPA, WIDTH_NAMES
from ..group_names import GROUP_NAMES
from .common import CLIError
from .commands import SUBCOMMANDS

JSON_VALID_SIZES = 16  # how many valid input sizes the JSON output lists
CHECK_BATCH_SIZE = 1  # the equivariance check's batch; the error does not depend on it


def _width(text: str) -> str | float:
    """A width name or a float kappa; convert/width.resolve_width checks its value."""
    if text in WIDTH_NAMES:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(WIDTH_NAMES)} or a number") from None


def _positive_int(text: str) -> int:
    """An image side, class or channel count: an integer >= 1, refused by argparse (naming the flag) otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def measurement_size(model, requested: int | None) -> int | None:
    """Where to measure equivariance: the requested size if valid, else the model's default.

    None when the model has no valid size and none was requested.
    """
    if requested is not None and model.report.input_size_valid:
        return requested
    try:
        return model.default_input_size()
    except ValueError:  # no size keeps exact equivariance: measure the requested one anyway
        return requested


def convert_and_check(
    model_spec: str,
    group: str,
    *,
    input_size: int | None = None,
    width: str | float | None = None,
    head: str | None = None,
    num_classes: int = 10,
    in_channels: int = 3,
    strict: bool = False,
    check: bool = True,
    pretrained: bool | str = False,
    pad_to_valid: bool = False,
    crop_to_valid: bool = False,
    allow_non_equivariant: bool = False,
    mode: str = DEFAULT_MODE,
) -> tuple[Any, dict]:
    """Build, convert and (optionally) check one model; returns (EquivariantModel, JSON record).

    A model that is equivariant by construction (the paper's preset) is built for `group` instead of converted.
    """
    from .. import check_equivariance, make_equivariant, parse_group
    from ..models import create_model
    from ..models._registry import is_equivariant_model
    from ..convert.width import resolve_width
    from ..progress import counting_basis_builds

    spec = parse_group(group)  # fail on a bad group or width before building anything
    resolve_width(width)
    options = {"width": width, "input_size": input_size, "strict": strict or None, "head": head}
    if is_equivariant_model(model_spec):
        if pretrained or pad_to_valid or crop_to_valid or allow_non_equivariant or mode != DEFAULT_MODE:
            raise CLIError(
                f"{model_spec} is built equivariant: --pretrained, --pad-to-valid, --crop-to-valid, --mode and "
                "--allow-non-equivariant apply to converted models only"
            )
        start = time.perf_counter()
        with counting_basis_builds(None):  # make_equivariant counts its own
            converted = create_model(
                model_spec, group=group, num_classes=num_classes, in_channels=in_channels, **options
            )
    else:
        model = create_model(
            model_spec, num_classes=num_classes, in_channels=in_channels, pretrained=pretrained or None
        )
        start = time.perf_counter()
        converted = make_equivariant(
            model,
            spec,
            pretrained=bool(pretrained),
            pad_to_valid=pad_to_valid,
            crop_to_valid=crop_to_valid,
            allow_non_equivariant=allow_non_equivariant,
            mode=mode,
            **options,
        )
    conversion_time = time.perf_counter() - start
    report = converted.report

    equivariance = None
    size = measurement_size(converted, input_size) if check else None
    if size is not None:
        start = time.perf_counter()
        result = check_equivariance(converted, input_size=size, batch_size=CHECK_BATCH_SIZE)
        report.max_equivariance_error = result.max_error
        equivariance = {
            "input_size": size,
            "input_size_valid": size in report.valid_input_sizes,
            "errors": dict(result.errors),
            "max_error": result.max_error,
            "check_time_s": round(time.perf_counter() - start, 3),
        }

    record = report.to_dict()
    record["num_valid_input_sizes"] = len(report.valid_input_sizes)
    record["valid_input_sizes"] = report.valid_input_sizes[:JSON_VALID_SIZES]
    record.update(
        model=model_spec,
        group=spec.name,
        conversion_time_s=round(conversion_time, 3),
        equivariance=equivariance,
    )
    return converted, record


def _check_summary(record: dict) -> str:
    eq = record["equivariance"]
    if eq is None:
        return "equivariance not checked"
    valid = "" if eq["input_size_valid"] else " (NOT a valid size: errors are not expected to be small)"
    lines = [f"equivariance check at input size {eq['input_size']}{valid}: max error {eq['max_error']:.2e}"]
    lines += [f"  {element}: {error:.2e}" for element, error in eq["errors"].items()]
    return "\n".join(lines)


def _cmd_convert(args: argparse.Namespace) -> int:
    # escnn or a model factory might print; keep stdout clean for the JSON object
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        converted, record = convert_and_check(
            args.model,
            args.group,
            input_size=args.input_size,
            width=args.width,
            head=args.head,
            num_classes=args.num_classes,
            in_channels=args.in_channels,
            strict=args.strict,
            check=not args.no_check,
            pretrained=args.pretrained,
            pad_to_valid=args.pad_to_valid,
            crop_to_valid=args.crop_to_valid,
            allow_non_equivariant=args.allow_non_equivariant,
            mode=args.mode,
        )
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"model {args.model}, converted in {record['conversion_time_s']:.2f} s")
    print(converted.report)
    print(_check_summary(record))
    return 0


def add_parser(sub) -> None:
    convert = sub.add_parser("convert", help=SUBCOMMANDS["convert"])
    convert.add_argument(
        "model",
        help="a registry name (equiconvert.models.list_models()): resnet9, "
        "equivariant_resnet9, torchvision:<name>, timm:<name>; bare names: "
        "equiconvert's, then torchvision's, then timm's",
    )
    convert.add_argument("--group", required=True, help=GROUP_NAMES)
    convert.add_argument("--input-size", type=_positive_int, default=None, help="the image size you will use (H = W)")
    convert.add_argument(
        "--width",
        type=_width,
        default=None,
        metavar="|".join((*WIDTH_NAMES, "<float>")),
        help=f"width policy: {', '.join(WIDTH_NAMES)} or a float kappa (default: {DEFAULT_WIDTH}, "
        f"with kappa = {PAPER_KAPPA})",
    )
    convert.add_argument(
        "--mode",
        choices=MODES,
        default=DEFAULT_MODE,
        help="full: the whole group in every layer; dp: the flips only from the last stage on and the original's "
        "parameter count, for DP training with your pipeline's own settings (docs/guides/converting-your-dp-pipeline.md)",
    )
    convert.add_argument("--head", choices=HEADS, default=None)
    convert.add_argument("--num-classes", type=_positive_int, default=10)
    convert.add_argument("--in-channels", type=_positive_int, default=3)
    strictness = convert.add_mutually_exclusive_group()
    strictness.add_argument("--strict", action="store_true", help="turn equivariance warnings into errors")
    strictness.add_argument(
        "--allow-non-equivariant",
        action="store_true",
        help="keep a model that no input size makes exactly equivariant (it is then approximately equivariant, "
        "with a warning naming the layers that break it); without it such a model is an error",
    )
    convert.add_argument("--json", action="store_true", help="print one JSON object")
    convert.add_argument("--no-check", action="store_true", help="skip the equivariance check")
    convert.add_argument(
        "--pretrained",
        nargs="?",
        const=True,
        default=False,
        metavar="WEIGHTS",
        help="build the model with its pretrained weights (torchvision: optionally a weights name, "
        "e.g. IMAGENET1K_V1); the report says which layers keep them",
    )
    fit = convert.add_mutually_exclusive_group()
    fit.add_argument(
        "--pad-to-valid",
        action="store_true",
        help="an --input-size that breaks exact equivariance is fitted, symmetrically, to the next valid "
        "size (224 -> 225 for resnet18) in front of the network; without it such a size is an error",
    )
    fit.add_argument(
        "--crop-to-valid",
        action="store_true",
        help="as --pad-to-valid, to the previous valid size, by symmetric cropping",
    )
    convert.set_defaults(func=_cmd_convert)
