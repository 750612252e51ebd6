"""Fingerprints (and the tensors) of the canonical bases a few models use, to compare machines.

The bases are built by equiconvert's own builder; two machines (NumPy/LAPACK builds, CPUs, Pythons) must give the
same fingerprints and bases equal to 1e-6. Writes a JSON summary and, with --save, a .pt file of the bases
(loadable with torch.load(weights_only=True)); --compare FILE checks this machine's bases against such a file.

    python benchmarks/basis_fingerprints.py --save bases_here.pt
    python benchmarks/basis_fingerprints.py --compare bases_here.pt   # on the other machine
"""

from __future__ import annotations

import argparse
import json
import platform

import numpy as np
import torch

import equiconvert
from equiconvert.nn.conv import SteerableConv2d

MODELS = (
    ("equivariant_resnet9", "D4"),
    ("equivariant_resnet9", "C8"),
    ("torchvision:resnet18", "D16"),
    ("torchvision:resnet18", "O2"),
)


def collect() -> dict[str, torch.Tensor]:
    """Every distinct basis (by fingerprint) of the models above."""
    bases: dict[str, torch.Tensor] = {}
    for name, group in MODELS:
        if equiconvert.models._registry.is_equivariant_model(name):
            model = equiconvert.create_model(name, group=group)
        else:
            model = equiconvert.make_equivariant(equiconvert.create_model(name, num_classes=10), group)
        for module in model.modules():
            if isinstance(module, SteerableConv2d):
                bases.setdefault(module.basis_fingerprint, module.basis.detach().cpu().clone())
    return bases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", default=None, help="write the bases to this .pt file")
    parser.add_argument("--compare", default=None, help="compare with the bases in this .pt file")
    args = parser.parse_args()
    bases = collect()
    summary: dict = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "bases": len(bases),
        "fingerprints": sorted(bases),
    }
    if args.save:
        torch.save(bases, args.save)
    if args.compare:
        other = torch.load(args.compare, weights_only=True)
        shared = sorted(set(other) & set(bases))
        summary["compare"] = {
            "same_fingerprints": sorted(other) == sorted(bases),
            "max_abs_difference": max((float((other[k] - bases[k]).abs().max()) for k in shared), default=None),
            "only_here": sorted(set(bases) - set(other)),
            "only_there": sorted(set(other) - set(bases)),
        }
    print(json.dumps(summary, indent=2))
    return 0 if not args.compare or summary["compare"]["same_fingerprints"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
