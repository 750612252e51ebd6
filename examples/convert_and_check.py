"""Convert a torchvision model to a D4-equivariant steerable CNN, check it, export it.

    python examples/convert_and_check.py                          # resnet18 -> D4, ~10 s on a CPU
    python examples/convert_and_check.py --arch resnet50 --group C8 --input-size 225 --verbose

Steps: build an ordinary torchvision model, convert it with one call, read the conversion
report (parameters before/after, the input sizes at which the result is exactly equivariant),
measure the equivariance error at a valid size, and export the model to plain torch.nn layers
whose outputs match the converted model's.
"""

from __future__ import annotations

import argparse

import torch
import torchvision

import equiconvert


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18", help="a torchvision.models builder (resnet18, vgg11_bn, ...)")
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--group", default="D4", help="C1..C16, D1..D16 (rotations, with reflections for D)")
    parser.add_argument(
        "--input-size", type=int, default=None, help="where to check equivariance (default: the first valid size >= 32)"
    )
    parser.add_argument("--batch-size", type=int, default=2, help="images per forward pass in the checks")
    parser.add_argument("--verbose", action="store_true", help="print the full report (every swapped layer)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)

    # 1. An ordinary, untrained torchvision model ...
    model = getattr(torchvision.models, args.arch)(num_classes=args.num_classes)
    # ... and its equivariant counterpart: every conv becomes a steerable conv, BatchNorm a
    # per-field group norm, and the global pooling a pooling over the group.
    model = equiconvert.make_equivariant(model, group=args.group, input_size=args.input_size)

    # 2. The conversion report: what changed and at which input sizes equivariance is exact.
    report = model.report
    print(report if args.verbose else f"{args.arch} -> {report.group}: {len(report.layers)} layers swapped")
    print(f"parameters before: {report.params_before:,}")
    print(f"parameters after: {report.params_after:,}")
    print(f"valid input sizes: {report.valid_input_rule} (first ones: {report.valid_input_sizes[:5]})")
    for warning in report.warnings:  # constructs that break exact equivariance, with where they are
        print(f"warning: {warning}")

    # 3. Measure it: logits of rotated/flipped inputs vs the rotated/flipped logits, for every
    # element of the group that acts exactly on the pixel grid. The requested size is used if it
    # is valid, else the first valid size >= 32 (33 for resnet18: 224 is not valid, 225 is).
    size = model.default_input_size()
    result = equiconvert.check_equivariance(model, input_size=size, batch_size=args.batch_size)
    for element, error in result.errors.items():
        print(f"  {element:>12}: {error:.2e}")
    print(f"max equivariance error at input size {size}: {result.max_error:.2e}")

    # 4. Export to standard torch layers (no equiconvert needed to run or unpickle it; ONNX-ready).
    plain = equiconvert.export(model).eval()
    model.eval()
    x = torch.randn(args.batch_size, model.in_channels, size, size)
    with torch.no_grad():
        ours, theirs = model(x), plain(x)
    difference = float((ours - theirs).abs().max() / ours.abs().max())
    modules = sorted({type(m).__module__.split(".")[0] for m in plain.modules()})
    print(f"exported model uses modules from: {', '.join(modules)}")
    print(f"max relative difference converted vs exported: {difference:.2e}")


if __name__ == "__main__":
    main()
