"""Fuzz of hand-written CNNs: seeded networks drawn from a grammar of what people write, converted and classified.

The grammar: a stem conv or none (the image then reaches the body: concatenations beside it are direct sums),
blocks that are plain, residual, dense (the block's maps concatenated beside its input) or split (a channel split,
half convolved, concatenated back, or a chunk swapped), slices of the newest dense block and narrows, 2x2 pooling
(max or average), GroupNorm / layer norm (one group) / InstanceNorm / BatchNorm / none, SELU / ELU / tanh / Mish /
ReLU / GELU / SiLU, and a head: global mean or adaptive pooling and flatten before a Linear, a flatten of the whole
map (made invariant by the default head="symmetric"), or a decoder (transposed conv or bilinear upsampling, the skip
concatenated, a 1x1 conv) with a per-pixel output. Each network ends in one outcome:

  exact     converted; its output changes by at most TOLERANCE under every D4 element at input size SIZE
  refused   a ConversionError in one line naming the node and the options
  warned    converted with an equivariance warning naming the node (a construct that is not equivariant)
  silent    anything else: a crash, or a conversion that is not exact and does not say so (a defect)

    python benchmarks/fuzz_convert.py [--count N] [--seed S] [--out PATH]

prints (and writes to --out) the JSON summary: the counts, the exact share, and each network's outcome.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # json_output, when run as a script

import equiconvert  # noqa: E402
from equiconvert.errors import ConversionError  # noqa: E402
from json_output import emit  # noqa: E402

TOLERANCE = 1e-5
GROUP = "D4"
SIZE = 16  # every network of the grammar is exact at it: stride-1 convs, at most two 2x2 pools
CLASSES = 5
ACTIVATIONS = (nn.ReLU, nn.SELU, nn.ELU, nn.Tanh, nn.Mish, nn.GELU, nn.SiLU)
NORMS = ("group", "layer", "instance", "batch", "none")
BLOCKS = ("plain", "residual", "dense", "dense", "split", "chunk")
HEADS = ("mean", "adaptive", "decoder", "decoder", "flatten")


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(next(g for g in (4, 2, 1) if channels % g == 0), channels)
    return {
        "layer": lambda: nn.GroupNorm(1, channels),
        "instance": lambda: nn.InstanceNorm2d(channels, affine=True),
        "batch": lambda: nn.BatchNorm2d(channels),
        "none": nn.Identity,
    }[kind]()


@dataclass
class Recipe:
    """What a network is made of, in words (the JSON names each network by it)."""

    steps: list[str] = field(default_factory=list)


class HandWritten(nn.Module):
    """A CNN drawn from the grammar by `rng`: its forward runs `plan`, a list of (step, layer name, argument)."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.layers = nn.ModuleDict()
        self.plan: list[tuple[str, str, object]] = []
        self.recipe = Recipe()
        norm, act = rng.choice(NORMS), rng.choice(ACTIVATIONS)
        self.recipe.steps.append(f"{norm} norm, {act.__name__}")
        channels = 3
        if rng.random() < 0.6:
            channels = rng.choice((8, 12, 16))
            self._add("seq", "stem", nn.Conv2d(3, channels, 3, padding=1), f"stem {channels}")
        pools, skip = 0, None
        for index in range(rng.randint(1, 3)):
            kind = rng.choice(BLOCKS)
            width = rng.choice((8, 12, 16))
            if kind == "chunk" and channels % 2:
                kind = "dense"
            if kind in ("split", "chunk") and channels < 4:
                kind = "plain"
            name = f"block{index}"
            if kind == "plain":
                self._add("seq", name, self._unit(channels, width, norm, act), f"plain {width}")
                channels = width
            elif kind == "residual":
                self._add("residual", name, self._unit(channels, channels, norm, act), "residual")
            elif kind == "dense":
                self._add("dense", name, self._unit(channels, width, norm, act), f"dense +{width}")
                channels += width
                if rng.random() < 0.3:
                    self._add("slice", "", width, f"slice newest {width}")
                    channels = width
                elif rng.random() < 0.2:
                    self._add("narrow", "", channels - 1, f"narrow to {channels - 1}")
                    channels -= 1
            elif kind == "split":
                first = rng.randint(1, channels - 1)
                unit = self._unit(first, first, norm, act)
                self._add("split", name, unit, f"split {first}+{channels - first}", arg=(first, channels - first))
            else:
                half = channels // 2
                self._add("chunk", name, self._unit(half, half, norm, act), "chunk halves, swapped")
            if pools < 2 and rng.random() < 0.4:
                if pools == 0:  # the decoder's skip connection
                    skip = channels
                    self.plan.append(("save", "", None))
                pool = rng.choice((nn.MaxPool2d(2), nn.AvgPool2d(2)))
                self._add("seq", f"pool{index}", pool, type(pool).__name__)
                pools += 1
        head = rng.choice(HEADS)
        if head == "decoder" and pools != 1:
            head = "mean"
        self._head(head, channels, skip, norm, act, rng)

    def _add(self, step: str, name: str, layer: object, words: str, arg: object = None) -> None:
        if isinstance(layer, nn.Module):
            self.layers[name] = layer
            self.plan.append((step, name, arg))
        else:
            self.plan.append((step, name, layer))
        self.recipe.steps.append(words)

    @staticmethod
    def _unit(channels: int, width: int, norm: str, act: type) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), _norm(norm, width), act())

    def _head(self, head: str, channels: int, skip: int | None, norm: str, act: type, rng: random.Random) -> None:
        self.head_kind = head
        if head == "decoder":
            up = rng.choice(("transposed2", "transposed4", "bilinear"))
            if up == "bilinear":
                self.layers["up"] = nn.Sequential(
                    nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(channels, 8, 1)
                )
            else:
                kernel, padding = (2, 0) if up == "transposed2" else (4, 1)
                self.layers["up"] = nn.ConvTranspose2d(channels, 8, kernel, stride=2, padding=padding)
            self.layers["fuse"] = self._unit(8 + skip, 8, norm, act)
            self.layers["out"] = nn.Conv2d(8, CLASSES, 1)
        elif head == "flatten":
            self.layers["out"] = nn.Linear(channels * self._side() ** 2, CLASSES)
        else:
            self.layers["out"] = nn.Linear(channels, CLASSES)
        self.recipe.steps.append(f"head {head}" + (f" ({up})" if head == "decoder" else ""))

    def _side(self) -> int:
        return SIZE // 2 ** sum(1 for step, name, _ in self.plan if name.startswith("pool"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        saved = x
        for step, name, arg in self.plan:
            if step == "seq":
                x = self.layers[name](x)
            elif step == "residual":
                x = x + self.layers[name](x)
            elif step == "dense":
                x = torch.cat((x, self.layers[name](x)), 1)
            elif step == "slice":
                x = x[:, -arg:]
            elif step == "narrow":
                x = x.narrow(1, 0, arg)
            elif step == "split":
                a, b = torch.split(x, list(arg), 1)
                x = torch.cat((self.layers[name](a), b), 1)
            elif step == "chunk":
                a, b = x.chunk(2, 1)
                x = torch.cat((b, self.layers[name](a)), 1)
            elif step == "save":
                saved = x
        return self._forward_head(x, saved)

    def _forward_head(self, x: torch.Tensor, saved: torch.Tensor) -> torch.Tensor:
        if self.head_kind == "decoder":
            return self.layers["out"](self.layers["fuse"](torch.cat((saved, self.layers["up"](x)), 1)))
        if self.head_kind == "flatten":
            return self.layers["out"](torch.flatten(x, 1))
        if self.head_kind == "adaptive":
            return self.layers["out"](torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
        return self.layers["out"](x.mean((2, 3)))


@dataclass
class Outcome:
    seed: int
    network: str
    outcome: str = "silent"
    params_before: int = 0
    params_after: int = 0
    max_error: float | None = None
    message: str = ""
    seconds: float = 0.0


def assess(seed: int) -> Outcome:
    """Draw the network of `seed`, convert it and classify the result."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    original = HandWritten(rng).eval()
    record = Outcome(
        seed, ", ".join(original.recipe.steps), params_before=sum(p.numel() for p in original.parameters())
    )
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # kept in the report, read below
            model = equiconvert.make_equivariant(original, GROUP, input_size=SIZE).eval()
        record.params_after = model.report.params_after
        record.max_error = equiconvert.check_equivariance(model, input_size=SIZE).max_error
    except ConversionError as exc:
        clear = "\n" not in str(exc) and "node" in str(exc) and "Options" in str(exc)
        record.outcome, record.message = ("refused" if clear else "silent"), str(exc)
        record.seconds = time.perf_counter() - start
        return record
    except Exception as exc:  # a crash is a defect: record it rather than stop the fuzz
        record.message = f"{type(exc).__name__}: {exc}"
        record.seconds = time.perf_counter() - start
        return record
    record.seconds = time.perf_counter() - start
    warned = [str(w) for w in model.report.warnings]
    if record.max_error <= TOLERANCE:
        record.outcome = "exact"
    elif warned:
        record.outcome, record.message = "warned", "; ".join(warned)
    return record


def summarise(records: list[Outcome]) -> dict:
    counts = {kind: sum(r.outcome == kind for r in records) for kind in ("exact", "refused", "warned", "silent")}
    return {
        "group": GROUP,
        "input_size": SIZE,
        "tolerance": TOLERANCE,
        "networks": len(records),
        "counts": counts,
        "exact_share": counts["exact"] / len(records) if records else None,
        "records": [asdict(r) for r in records],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100, help="how many networks (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="the first network's seed (default 0)")
    parser.add_argument("--out", default=None, help="write the JSON summary here as well")
    args = parser.parse_args(argv)
    summary = summarise([assess(seed) for seed in range(args.seed, args.seed + args.count)])
    print(emit(summary, args.out))
    return summary


if __name__ == "__main__":
    main()
