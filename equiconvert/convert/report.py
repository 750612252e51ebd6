"""What a conversion did: swapped layers, parameter counts, valid input sizes, warnings."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class LayerChange:
    node: str
    module_path: str
    before: str
    after: str


class EquivarianceWarning(UserWarning):
    """A construct that breaks exact equivariance, with where it is.

    Kept in ConversionReport.warnings and issued by make_equivariant through warnings.warn,
    so it can be filtered or turned into an error like any Python warning.
    """

    def __init__(self, node: str, module_path: str, source: str, message: str) -> None:
        super().__init__(node, module_path, source, message)  # args rebuild it when unpickled
        self.node, self.module_path, self.source, self.message = node, module_path, source, message

    def __str__(self) -> str:
        where = f"node {self.node!r}" + (f" (module {self.module_path!r})" if self.module_path else "")
        src = f" at {self.source}" if self.source else ""
        return f"{where}{src}: {self.message}"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.args == other.args

    def __hash__(self) -> int:
        return hash(self.args)

    def to_dict(self) -> dict[str, str]:
        return {"node": self.node, "module_path": self.module_path, "source": self.source, "message": self.message}


# The full-group conversion lost 6.5 points in Opacus' CIFAR-10 example trained with its own settings, where
# mode="dp" gained (docs/guides/converting-your-dp-pipeline.md): say so wherever a full conversion is reported.
DP_HINT = (
    "to train with your DP pipeline's own hyper-parameters, convert with mode='dp' (restricts to the flips before "
    "the last stage, keeps the parameter count); the full group can cost accuracy there, most in small networks "
    "without normalisation: docs/guides/converting-your-dp-pipeline.md"
)


@dataclass
class ConversionReport:
    group: str
    width: str
    mode: str = "full"  # conversion_options.MODES: what the conversion aims at (convert/modes.py)
    mode_reason: str = ""  # what the mode chose, in a sentence
    params_before: int = 0
    params_after: int = 0
    layers: list[LayerChange] = field(default_factory=list)
    warnings: list[EquivarianceWarning] = field(default_factory=list)
    valid_input_sizes: list[int] = field(default_factory=list)
    valid_input_rule: str = ""
    input_size: int | None = None
    input_size_valid: bool | None = None
    input_fit: str | None = None  # how a requested size is fitted to a valid one (pad_to_valid / crop_to_valid)
    invariant_output: bool = False
    per_pixel_output: bool = False  # a map of invariant fields (segmentation): it turns and flips with the input
    max_equivariance_error: float | None = None
    fused_norm_pools: int = 0  # norm -> window max pool pairs fused into one layer (config fuse_norm_pools)
    # with make_equivariant(..., pretrained=True): parametrised layers that kept / lost the original's weights
    weights_kept: list[str] | None = None
    weights_reinitialised: list[str] | None = None
    weights_warning: str | None = None

    def output_kind(self) -> str:
        """How the output answers a rotation or flip of the input."""
        if self.per_pixel_output:
            return "per-pixel equivariant (each pixel's output is invariant; the map turns and flips with the input)"
        return "invariant" if self.invariant_output else "NOT invariant"

    def to_dict(self) -> dict:
        data = asdict(self)
        data["warnings"] = [dict(w.to_dict(), text=str(w)) for w in self.warnings]
        return data

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [
            f"group {self.group}, width {self.width}: {self.params_before:,} -> {self.params_after:,} parameters",
            f"mode {self.mode}: {self.mode_reason}" if self.mode_reason else f"mode {self.mode}",
            f"valid input sizes: {self.valid_input_rule}",
        ]
        if self.mode == "full":
            lines.append(DP_HINT)
        if self.input_size is not None:
            lines.append(f"input size {self.input_size}: {'valid' if self.input_size_valid else 'NOT valid'}")
        if self.input_fit is not None:
            lines.append(f"input fit: {self.input_fit}")
        lines.append(f"output: {self.output_kind()}")
        if self.fused_norm_pools:
            lines.append(f"fused norm -> max pool pairs: {self.fused_norm_pools}")
        lines += [f"  {c.node}: {c.before} -> {c.after}" for c in self.layers]
        lines += [f"warning: {w}" for w in self.warnings]
        if self.weights_warning is not None:
            lines.append(f"warning: {self.weights_warning}")
        if self.max_equivariance_error is not None:
            lines.append(f"max equivariance error: {self.max_equivariance_error:.2e}")
        return "\n".join(lines)
