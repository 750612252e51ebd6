"""A converted timm model stays a timm model: `num_classes`, `num_features`, `get_classifier`, `reset_classifier`,
`pretrained_cfg`/`default_cfg`, `forward_features` and `forward_head`, with values true of the converted network.

timm's data and training helpers (`resolve_data_config`, `create_transform`, `train.py`) read these. The converted
network takes other input sizes than the original (the valid sizes of its grid), so `pretrained_cfg["input_size"]`
is the valid size nearest the original's, with the model's channels, and mean and std have one entry per channel.
The classifier is the converted head's `nn.Linear`, at the original's path under `network.`; features and head
are split where the original's global pooling (timm's `global_pool`) begins.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..errors import ParameterError, UnsupportedLayerError
from ..groups import GroupSpec
from .fields import FieldType
from .model import EquivariantModel, check_input
from .report import ConversionReport

NETWORK = "network"  # the attribute of EquivariantModel that holds the converted GraphModule


@dataclass(frozen=True)
class TimmHead:
    """What the original timm model said about its head and data: plain values, kept with the converted model."""

    pretrained_cfg: dict[str, Any] = field(hash=False)
    classifier: str  # the classifier's module path in the original (and in the converted network)
    global_pool: str  # the module path where the original's forward_head begins ("" where it has none)
    pool_type: str  # timm's global_pool setting ("avg", ...)
    num_classes: int


def is_timm_model(model: nn.Module) -> bool:
    """Duck-typed: timm models carry a pretrained_cfg dict and reset_classifier (timm need not be imported)."""
    return isinstance(getattr(model, "pretrained_cfg", None), dict) and callable(
        getattr(model, "reset_classifier", None)
    )


def timm_head(model: nn.Module) -> TimmHead:
    """The head and data settings of the timm model `model`."""
    cfg = dict(model.pretrained_cfg)
    classifier = cfg.get("classifier") or ""
    pools = [name for name, module in model.named_modules() if type(module).__name__ == "SelectAdaptivePool2d"]
    pool = getattr(model, "global_pool", "avg")
    return TimmHead(
        pretrained_cfg=cfg,
        classifier=classifier if isinstance(classifier, str) else classifier[0],
        global_pool=pools[0] if pools else "",
        pool_type=getattr(pool, "pool_type", pool) if not isinstance(pool, str) else pool,
        num_classes=int(getattr(model, "num_classes", 0)),
    )


def build_equivariant_model(
    original: nn.Module,
    network: fx.GraphModule,
    group: GroupSpec,
    in_channels: int,
    output_type: FieldType | None,
    report: ConversionReport,
) -> EquivariantModel:
    """An EquivariantModel; a TimmEquivariantModel (timm's model API) where `original` is a timm model."""
    if is_timm_model(original) and isinstance(_submodule(network, timm_head(original).classifier), nn.Linear):
        return TimmEquivariantModel(network, group, in_channels, output_type, report, timm_head(original))
    return EquivariantModel(network, group, in_channels, output_type, report)


def _submodule(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path) if path else None
    except AttributeError:
        return None


class TimmEquivariantModel(EquivariantModel):
    """A converted timm model with timm's model API (see the module docstring)."""

    def __init__(
        self,
        network: fx.GraphModule,
        group: GroupSpec,
        in_channels: int,
        output_type: FieldType | None,
        report: ConversionReport,
        head: TimmHead,
    ) -> None:
        super().__init__(network, group, in_channels, output_type, report)
        self.timm_head = head
        self.num_classes = head.num_classes
        self.global_pool = head.pool_type
        self._parts: dict[str, fx.GraphModule] = {}  # forward_features / forward_head graphs, built on first use
        self._num_features: int | None = None  # measured on first use (the classifier does not change it)

    # --- data ----------------------------------------------------------------------------------------
    @property
    def pretrained_cfg(self) -> dict[str, Any]:
        """The original's pretrained_cfg with a valid input size, this model's channels and classifier."""
        cfg = copy.deepcopy(self.timm_head.pretrained_cfg)
        size = self.data_input_size(cfg.get("input_size"))
        cfg["input_size"] = (self.in_channels, size, size)
        cfg.pop("test_input_size", None)  # a size for the original only
        for key in ("mean", "std"):
            if key in cfg and len(cfg[key]) != self.in_channels:
                cfg[key] = (sum(cfg[key]) / len(cfg[key]),) * self.in_channels
        cfg["num_classes"] = self.num_classes
        cfg["classifier"] = f"{NETWORK}.{self.timm_head.classifier}"
        first_conv = cfg.get("first_conv")
        cfg["first_conv"] = f"{NETWORK}.{first_conv}" if isinstance(first_conv, str) else first_conv
        return cfg

    @property
    def default_cfg(self) -> dict[str, Any]:
        return self.pretrained_cfg

    def data_input_size(self, original: Any = None) -> int:
        """The valid input size nearest the original's (`original`: its (C, H, W)); the requested size if valid."""
        report = self.report
        if report.input_size is not None and report.input_size_valid:
            return report.input_size
        valid = report.valid_input_sizes
        if not valid or not original:
            return self.default_input_size()
        target = int(original[-1])
        return min(valid, key=lambda size: (abs(size - target), -size))

    # --- classifier ----------------------------------------------------------------------------------
    def get_classifier(self) -> nn.Module:
        return self.network.get_submodule(self.timm_head.classifier)

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new classifier for `num_classes` classes (0: none, the invariant features are returned)."""
        if global_pool is not None and global_pool != self.global_pool:
            raise ParameterError(
                f"reset_classifier(global_pool={global_pool!r}): the converted head pools with "
                f"{self.global_pool!r} and then over the group; build the timm model with global_pool="
                f"{global_pool!r} and convert it again"
            )
        old = self.get_classifier()
        in_features = self.head_hidden_size
        new = nn.Linear(in_features, num_classes) if num_classes > 0 else nn.Identity()
        if isinstance(old, nn.Linear):
            new = new.to(device=old.weight.device, dtype=old.weight.dtype)
        self.network.set_submodule(self.timm_head.classifier, new)
        self.num_classes = num_classes
        self._parts.clear()

    @property
    def head_hidden_size(self) -> int:
        """Invariant features entering the classifier."""
        classifier = self.get_classifier()
        if isinstance(classifier, nn.Linear):
            return classifier.in_features
        with torch.no_grad():
            return int(self.forward_head(self.forward_features(self._probe()), pre_logits=True).shape[1])

    @property
    def num_features(self) -> int:
        """Channels of the feature map forward_features returns (fields times their size)."""
        if self._num_features is None:
            with torch.no_grad():
                self._num_features = int(self.forward_features(self._probe()).shape[1])
        return self._num_features

    def _probe(self) -> torch.Tensor:
        parameter = next(self.parameters(), None)
        size = self.default_input_size()
        return torch.zeros(1, self.in_channels, size, size, device=None if parameter is None else parameter.device)

    # --- features and head ---------------------------------------------------------------------------
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The feature map before the global pooling (equivariant fields)."""
        check_input(x, self.in_channels)
        return self._part("features")(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Global pooling, group pooling and the classifier; pre_logits: the invariant features before it."""
        return self._part("pre_logits" if pre_logits else "head")(x)

    def _part(self, name: str) -> fx.GraphModule:
        if not self._parts:
            self._parts.update(_split(self.network, self.timm_head))
        return self._parts[name]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_parts"] = {}  # rebuilt on use; the graphs share the network's modules
        return state


def _split(network: fx.GraphModule, head: TimmHead) -> dict[str, fx.GraphModule]:
    """GraphModules for the features, the head and the head's pre-logits, sharing `network`'s modules."""
    nodes = list(network.graph.nodes)
    pool = next(
        (n for n in nodes if n.op == "call_module" and head.global_pool and _under(n.target, head.global_pool)), None
    )
    classifier = next((n for n in nodes if n.op == "call_module" and n.target == head.classifier), None)
    if pool is None or classifier is None or not isinstance(pool.args[0], fx.Node):
        raise UnsupportedLayerError(
            f"forward_features / forward_head: the converted network has no global pooling at {head.global_pool!r} "
            f"before its classifier {head.classifier!r}; call the model itself (it returns the logits)"
        )
    features = pool.args[0]
    output = next(n for n in nodes if n.op == "output")
    return {
        "features": _subgraph(network, None, features),
        "head": _subgraph(network, features, output.args[0]),
        "pre_logits": _subgraph(network, features, classifier.args[0]),
    }


def _under(target: str, path: str) -> bool:
    return target == path or target.startswith(path + ".")


def _subgraph(network: fx.GraphModule, start: fx.Node | None, end: fx.Node) -> fx.GraphModule:
    """The nodes from `start` (a new input; None: the network's own input) up to `end`, as a GraphModule."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    if start is not None:
        env[start] = graph.placeholder("x")
    for node in network.graph.nodes:
        if node is start or node.op == "output":
            continue
        if start is not None and node.op == "placeholder":
            continue
        if all(arg in env for arg in node.all_input_nodes):
            env[node] = graph.node_copy(node, lambda arg: env[arg])
        if node is end:
            break
    if end not in env:
        raise UnsupportedLayerError(
            f"forward_head: node {end.name!r} of the converted head reads more than the feature map; call the model "
            "itself (it returns the logits)"
        )
    graph.output(env[end])
    part = fx.GraphModule(network, graph)
    part.graph.eliminate_dead_code()
    part.recompile()
    return part
