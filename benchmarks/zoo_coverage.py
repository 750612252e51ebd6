"""Zoo coverage: convert torchvision and timm CNNs (untrained, small heads) and record what happens to each.

Each architecture ends in one outcome:
  exact       converted; the logits change by at most TOLERANCE under every C4 element at a valid size
  no-exact    no input size keeps exact equivariance: kept with allow_non_equivariant=True, converts and runs, and
              the warning names the layers that break it (refused without that option)
  refused     UnsupportedLayerError / TracingError naming the node, module and options
  crash       anything else, or a converted model that is not exact at a size it calls valid (a defect)

    python benchmarks/zoo_coverage.py [--only NAME ...] [--json PATH] [--markdown PATH]

writes the table (architecture, outcome, parameters before/after, valid sizes, conversion time) as
JSON and as Markdown (docs/coverage.md by default).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import equiconvert

TOLERANCE = 1e-5
GROUP = "C4"
# allow_non_equivariant: a model exact at no size is kept (and classified no-exact) rather than refused
CONVERSION = {"head": "invariant", "config": {"even_kernels": "grow"}, "allow_non_equivariant": True}
NUM_CLASSES = 4


def _timm(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=NUM_CLASSES, **kwargs)

    return build


def _torchvision(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name, weights=None, num_classes=NUM_CLASSES, **kwargs)

    return build


def _tv_convnext_small() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    stages = [
        CNBlockConfig(16, 32, 1),
        CNBlockConfig(32, 64, 1),
        CNBlockConfig(64, 128, 1),
        CNBlockConfig(128, None, 1),
    ]
    return ConvNeXt(stages, num_classes=NUM_CLASSES)


# every torchvision classification CNN (transformers excluded), one variant per family at its smallest size
TORCHVISION: dict[str, Callable[[], nn.Module]] = {
    "alexnet": _torchvision("alexnet"),
    "convnext (small widths)": _tv_convnext_small,
    "densenet121": _torchvision("densenet121"),
    "efficientnet_b0": _torchvision("efficientnet_b0"),
    "efficientnet_v2_s": _torchvision("efficientnet_v2_s"),
    "googlenet": _torchvision("googlenet", aux_logits=False, init_weights=False),
    "inception_v3": _torchvision("inception_v3", aux_logits=False, init_weights=False),
    "mnasnet0_5": _torchvision("mnasnet0_5"),
    "mobilenet_v2": _torchvision("mobilenet_v2"),
    "mobilenet_v3_small": _torchvision("mobilenet_v3_small"),
    "regnet_x_400mf": _torchvision("regnet_x_400mf"),
    "regnet_y_400mf": _torchvision("regnet_y_400mf"),
    "resnet18": _torchvision("resnet18"),
    "resnext50_32x4d": _torchvision("resnext50_32x4d"),
    "shufflenet_v2_x0_5": _torchvision("shufflenet_v2_x0_5"),
    "squeezenet1_1": _torchvision("squeezenet1_1"),
    "vgg11_bn": _torchvision("vgg11_bn"),
    "wide_resnet50_2": _torchvision("wide_resnet50_2"),
}

# timm CNNs across families, each at its smallest registered size (ConvNeXt at small widths)
TIMM: dict[str, Callable[[], nn.Module]] = {
    "resnet10t": _timm("resnet10t"),
    "resnet18": _timm("resnet18"),
    "resnet26d": _timm("resnet26d"),
    "resnet50d": _timm("resnet50d"),
    "seresnet18": _timm("seresnet18"),
    "ecaresnet26t": _timm("ecaresnet26t"),
    "resnext26ts": _timm("resnext26ts"),
    "resnetv2_50": _timm("resnetv2_50"),
    "resnetrs50": _timm("resnetrs50"),
    "skresnet18": _timm("skresnet18"),
    "res2net50_14w_8s": _timm("res2net50_14w_8s"),
    "resnest14d": _timm("resnest14d"),
    "efficientnet_b0": _timm("efficientnet_b0"),
    "efficientnet_lite0": _timm("efficientnet_lite0"),
    "tf_efficientnet_b0": _timm("tf_efficientnet_b0"),
    "efficientnetv2_rw_t": _timm("efficientnetv2_rw_t"),
    "mobilenetv2_050": _timm("mobilenetv2_050"),
    "mobilenetv3_small_050": _timm("mobilenetv3_small_050"),
    "mobilenetv3_large_075": _timm("mobilenetv3_large_075"),
    "mnasnet_small": _timm("mnasnet_small"),
    "fbnetc_100": _timm("fbnetc_100"),
    "spnasnet_100": _timm("spnasnet_100"),
    "tinynet_e": _timm("tinynet_e"),
    "lcnet_050": _timm("lcnet_050"),
    "mixnet_s": _timm("mixnet_s"),
    "ghostnet_050": _timm("ghostnet_050"),
    "regnetx_002": _timm("regnetx_002"),
    "regnety_002": _timm("regnety_002"),
    "regnetz_005": _timm("regnetz_005"),
    "cspresnet50": _timm("cspresnet50"),
    "cspdarknet53": _timm("cspdarknet53"),
    "cs3darknet_s": _timm("cs3darknet_s"),
    "darknet17": _timm("darknet17"),
    "repvgg_a0": _timm("repvgg_a0"),
    "mobileone_s0": _timm("mobileone_s0"),
    "densenet121": _timm("densenet121"),
    "dpn48b": _timm("dpn48b"),
    "rexnet_100": _timm("rexnet_100"),
    "dla34": _timm("dla34"),
    "dla46_c": _timm("dla46_c"),
    "hrnet_w18_small": _timm("hrnet_w18_small"),
    "selecsls42b": _timm("selecsls42b"),
    "vgg11_bn": _timm("vgg11_bn"),
    "ese_vovnet19b_slim_dw": _timm("ese_vovnet19b_slim_dw"),
    "gernet_s": _timm("gernet_s"),
    "nf_resnet26": _timm("nf_resnet26"),
    "convnext_tiny (small widths)": _timm("convnext_tiny", dims=(16, 32, 64, 128), depths=(1, 1, 1, 1)),
    "convnext_tiny conv_mlp (small widths)": _timm(
        "convnext_tiny", dims=(16, 32, 64, 128), depths=(1, 1, 1, 1), conv_mlp=True
    ),
    "inception_v3": _timm("inception_v3"),
    "xception41": _timm("xception41"),
    "tresnet_m": _timm("tresnet_m"),
    "hgnetv2_b0": _timm("hgnetv2_b0"),
}


RULE_NOTES = [
    "- norm-act layers (BatchNormAct2d, GroupNormAct, LayerNormAct2d, FrozenBatchNormAct2d) -> FieldGroupNorm or "
    "FieldLayerNorm + the activation; EvoNorm2dS0/S1/S2 (and 'a' forms) -> FieldEvoNorm (per-sample statistics over "
    "whole fields); EvoNorm2dB0/B1/B2 are refused: their batch variance mixes examples",
    "- channel split/chunk/slice and cat: field counts are chosen so that every piece is whole fields (a channel "
    "count cut differently in several places is cut at all those places; grouped convs round the pieces)",
    "- SE/ECA gates, SKNet's selective kernel and ResNeSt's split attention: weights per whole field from group-pooled "
    "(invariant) statistics",
    "- VGG's ConvMlp: traced with its minimum-size pooling as one node; HGNet's one-sided pad before 2x2 windows: "
    "a centred pad before 3x3 windows (even_kernels='grow')",
    "- nearest/bilinear/bicubic upsampling by an integer factor: exact at every size",
    "- TResNet's space-to-depth stem: each orbit of a 4x4 block's positions under C2/C4 becomes a regular field "
    "(reflection groups are refused: they fix a block's diagonals); BlurPool2d: its symmetric blur on every channel",
]


@dataclass
class Outcome:
    architecture: str
    source: str
    outcome: str
    params_before: int = 0
    params_after: int = 0
    valid_sizes: str = ""
    checked_size: int | None = None
    max_error: float | None = None
    seconds: float = 0.0
    message: str = ""


def assess(source: str, name: str, build: Callable[[], nn.Module]) -> Outcome:
    """Convert one architecture and classify the result."""
    torch.manual_seed(0)
    original = build().eval()
    record = Outcome(name, source, "crash", params_before=sum(p.numel() for p in original.parameters()))
    start = time.perf_counter()
    try:
        model = equiconvert.make_equivariant(original, GROUP, **CONVERSION).eval()
    except (equiconvert.UnsupportedLayerError, equiconvert.TracingError) as exc:
        record.outcome, record.message = "refused", str(exc)
        record.seconds = time.perf_counter() - start
        return record
    except Exception as exc:  # a crash is a defect: record it rather than stop the table
        record.message = f"{type(exc).__name__}: {exc}"
        record.seconds = time.perf_counter() - start
        return record
    record.seconds = time.perf_counter() - start
    report = model.report
    record.params_after, record.valid_sizes = report.params_after, report.valid_input_rule
    if not report.valid_input_sizes:
        record.outcome = "no-exact"
        record.message = "; ".join(str(w) for w in report.warnings)
        return record
    size = model.default_input_size()
    result = _check_in_float64(model, size)
    record.checked_size, record.max_error = size, result.max_error
    record.outcome = "exact" if result.max_error <= TOLERANCE and report.invariant_output else "crash"
    if record.outcome == "crash":
        record.message = f"equivariance error {result.max_error:.2e} at valid size {size}"
    return record


def _check_in_float64(model: nn.Module, size: int) -> equiconvert.EquivarianceResult:
    """The equivariance check in float64: deep untrained nets sum fp32 rounding near 1e-5 (bases are exact)."""
    return equiconvert.check_equivariance(model.double(), input_size=size, batch_size=1)


def zoo(only: list[str] | None = None) -> list[tuple[str, str, Callable[[], nn.Module]]]:
    entries = [("torchvision", n, b) for n, b in TORCHVISION.items()] + [("timm", n, b) for n, b in TIMM.items()]
    return [e for e in entries if not only or e[1] in only]


def summary(records: list[Outcome]) -> dict[str, dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for r in records:
        counts.setdefault(r.source, {}).setdefault(r.outcome, 0)
        counts[r.source][r.outcome] += 1
    return counts


def environment() -> str:
    """The date and library versions of this run, so the table says what produced it."""
    import platform

    import torchvision

    try:
        import timm

        timm_version = timm.__version__
    except ModuleNotFoundError:
        timm_version = "not installed"
    return (
        f"{time.strftime('%Y-%m-%d', time.gmtime())}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
        f"timm {timm_version}, CPU ({platform.machine()})"
    )


def _write(args: argparse.Namespace, records: list[Outcome], command: str, env: str) -> None:
    """The JSON (with the run's environment) and the Markdown table."""
    table = {"summary": summary(records), "environment": env, "records": [asdict(r) for r in records]}
    args.json.write_text(json.dumps(table, indent=1))
    args.markdown.write_text(markdown(records, command, env))


def markdown(records: list[Outcome], command: str, env: str) -> str:
    lines = [
        "# Zoo coverage",
        "",
        f"Generated by `{command}` ({env}; untrained models, {NUM_CLASSES} classes, group {GROUP}, "
        "head='invariant', even_kernels='grow', allow_non_equivariant=True; the check runs in float64). Outcomes: "
        f"**exact** (logits change by at most {TOLERANCE:g} under every {GROUP} element at the checked valid size), "
        "**no-exact** (no input size keeps exact equivariance: refused by default, kept here by "
        "allow_non_equivariant=True, converts and runs; the warning names the layers that break it), **refused** "
        "(UnsupportedLayerError or "
        "TracingError naming the node, module and options), **crash** (a defect).",
        "",
    ]
    for source, counts in summary(records).items():
        total = sum(counts.values())
        parts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        lines.append(f"- {source}: {total} architectures: {parts} ({counts.get('exact', 0) / total:.0%} exact)")
    lines += ["", "Layers of these models and their equivariant forms:", "", *RULE_NOTES]
    lines += [
        "",
        "| source | architecture | outcome | params before | params after | valid sizes | checked size | "
        "conversion s | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        note = re.sub(r"\S*/site-packages/", "", r.message.split(". Options")[0]).replace("|", "/").replace("\n", " ")
        note = note[:200]
        lines.append(
            f"| {r.source} | {r.architecture} | {r.outcome} | {r.params_before:,} | {r.params_after:,} | "
            f"{r.valid_sizes} | {r.checked_size or ''} | {r.seconds:.1f} | {note} |"
        )
    return "\n".join(lines) + "\n"


def _merge(args: argparse.Namespace) -> list[Outcome]:
    """One table from several runs' JSON files, in zoo order (a later file wins for an architecture)."""
    found, envs = {}, []
    for path in args.merge:
        table = json.loads(path.read_text())
        envs.append(table.get("environment", "environment not recorded"))
        for row in table["records"]:
            found[(row["source"], row["architecture"])] = Outcome(**row)
    records = [found[(source, name)] for source, name, _ in zoo() if (source, name) in found]
    names = " ".join(str(p) for p in args.merge)
    _write(args, records, f"python benchmarks/zoo_coverage.py --merge {names}", " / ".join(dict.fromkeys(envs)))
    return records


def main(argv: list[str] | None = None) -> list[Outcome]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="architecture names (default: the whole zoo)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/zoo_coverage.json"))
    parser.add_argument("--markdown", type=Path, default=Path("docs/coverage.md"))
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="*",
        help="build the table from the JSON files of earlier (partial) runs instead of converting",
    )
    args = parser.parse_args(argv)
    if args.merge:
        return _merge(args)
    command = "python benchmarks/zoo_coverage.py" + (f" --only {' '.join(map(repr, args.only))}" if args.only else "")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    records, env = [], environment()
    for source, name, build in zoo(args.only):
        records.append(assess(source, name, build))
        r = records[-1]
        print(f"{source:12s} {name:40s} {r.outcome:9s} {r.seconds:6.1f}s {r.message[:100]}", flush=True)
        # written after every architecture: an interrupted run still leaves the rows it finished
        _write(args, records, command, env)
    return records


if __name__ == "__main__":
    main()
