"""The released model against ours: the released weights mapped onto our preset with the released code's options
through their dense filters, each stage's activations and the logits compared, parameter counts per layer; and the
released function itself, weight standardization on in both, with ours standardizing in escnn's coordinates."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # the package and the sibling modules, also when loaded by path
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from released_code import released_model  # noqa: E402

from equiconvert.conversion_options import CANONICAL_COORDINATES, ESCNN_COORDINATES  # noqa: E402
from equiconvert.models import equivariant_resnet9  # noqa: E402
from equiconvert.nn import SteerableConv2d  # noqa: E402
from equiconvert.nn.conv import coordinate_change  # noqa: E402
from equiconvert.recipes.recipe import load_recipe  # noqa: E402
from equiconvert.recipes.run_spec import spec_of  # noqa: E402

RELEASED_RECIPE = "cifar10_paper_d4_eps8_released"
# the released network's blocks in forward order, and the stage of ours each one's output is compared with
RELEASED_CONVS = ("conv1", "conv2", "res1.0", "res1.1", "conv3", "conv4", "res2.0", "res2.1")
STAGES = (
    ("conv1", "stem.2"),
    ("conv2", "layer1.3"),
    ("scale_norm1", "res1.scale_norm"),
    ("conv3", "layer2.3"),
    ("conv4", "layer3.3"),
    ("scale_norm2", "res2.scale_norm"),
)  # ours: the stage's last module


def released_convs(model: nn.Module) -> list[nn.Module]:
    return [model.get_submodule(f"{name}.conv.conv") for name in RELEASED_CONVS]


def our_convs(model: nn.Module) -> list[SteerableConv2d]:
    return [m for m in model.modules() if isinstance(m, SteerableConv2d)]


def _probe(module: Callable[[torch.Tensor], torch.Tensor], channels: int) -> torch.Tensor:
    """The (out, in) matrix of a linear channel map, applied to the unit vectors."""
    eye = torch.eye(channels).reshape(channels, channels, 1, 1)
    return module(eye)[:, :, 0, 0].T


def _span_residual(blocks: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Relative distance of each flattened block (rows) from the span of the basis (rows)."""
    q, _ = torch.linalg.qr(basis.T.double())
    blocks = blocks.double()
    return (blocks - (blocks @ q) @ q.T).norm(dim=-1) / blocks.norm(dim=-1).clamp_min(1e-30)


def _blocks(filt: torch.Tensor, out_size: int, in_size: int, out_perm, in_perm, fields: int) -> torch.Tensor:
    """Flattened (out field, in field) blocks of a dense filter, channels permuted within fields."""
    rows = []
    for of in range(min(fields, filt.shape[0] // out_size)):
        for inf in range(min(fields, filt.shape[1] // in_size)):
            o = [of * out_size + p for p in out_perm]
            i = [inf * in_size + p for p in in_perm]
            rows.append(filt[o][:, i].reshape(-1))
    return torch.stack(rows)


def _field_permutation(rel_filters: list[torch.Tensor], convs: list[SteerableConv2d]) -> list[int]:
    """The permutation of a regular field's channels that takes the released layout to ours: the one under which
    the released filters of the given layers lie in our layers' spans (found by search; |G|! candidates)."""
    size = convs[-1].out_size
    best, best_res = None, math.inf
    for perm in itertools.permutations(range(size)):
        res = 0.0
        for filt, conv in zip(rel_filters, convs):
            ip = perm if conv.in_size == size else range(conv.in_size)
            blocks = _blocks(filt, conv.out_size, conv.in_size, perm, ip, fields=2)
            res = max(res, float(_span_residual(blocks, conv.basis.reshape(conv.num_basis, -1)).max()))
            if res > best_res:
                break
        if res < best_res:
            best, best_res = list(perm), res
        if best_res < 1e-6:
            break
    return best


def _channel_index(fields: int, perm: list[int]) -> torch.Tensor:
    """For each channel of ours, the released channel it is: field-major, permuted within fields."""
    size = len(perm)
    return torch.tensor([f * size + p for f in range(fields) for p in perm])


@dataclass
class Mapping:
    """Released weights expressed in our model: the D4 and D2 channel correspondences and, per conv, the dense
    filter ours must have (in our channel order) with the residual of its projection onto our basis."""

    d4_index: torch.Tensor
    d2_index: torch.Tensor
    targets: list[torch.Tensor]
    biases: list[torch.Tensor]


def map_released(released: nn.Module, ours: nn.Module, standardized: bool = True) -> Mapping:
    """Dense filters of the released convs (after its weight standardization, or of its raw coefficients) in our
    channel layout; the released restriction + disentangle and our FieldRestriction are folded into the first conv
    after them."""
    rel_convs, mine = released_convs(released), our_convs(ours)
    with torch.no_grad():
        expanded = [conv.expand_parameters() for conv in rel_convs]
        if standardized:
            filters = [f.detach() for f, _ in expanded]
        else:
            filters = [conv.basisexpansion(conv.weights).reshape(f.shape) for conv, (f, _) in zip(rel_convs, expanded)]
        biases = [b.detach() for _, b in expanded]
        disentangle = _probe(
            lambda x: released.restrict(_group_tensor(x, released.restrict.in_type)).tensor,
            released.restrict.in_type.size,
        )
        restriction = next(m for n, m in ours.named_modules() if type(m).__name__ == "FieldRestriction")
        ours_restrict = _probe(restriction, len(restriction.index))
    filters[5] = torch.einsum("ojhw,ji->oihw", filters[5], disentangle)  # conv4 on conv3's channels
    d4 = _field_permutation(filters[:2], mine[:2])
    d4_index_full = _channel_index(filters[4].shape[0] // 8, d4)
    # the released conv4 on conv3's channels in our D4 order, then on our restricted channels
    conv4 = filters[5][:, d4_index_full]
    conv4_ours_in = torch.einsum("ojhw,ji->oihw", conv4, torch.linalg.inv(ours_restrict))
    d2 = _field_permutation([filters[6], filters[7]], mine[6:8])
    targets, out_biases = [], []
    for i, (filt, bias, conv) in enumerate(zip(filters, biases, mine)):
        if i == 5:
            filt = conv4_ours_in
        out_index = _channel_index(conv.out_fields, d4 if conv.out_size == 8 else d2)
        if i == 0:
            in_index = torch.arange(conv.in_channels)
        elif i == 5:
            in_index = torch.arange(conv.in_channels)  # already ours
        else:
            in_index = _channel_index(conv.in_fields, d4 if conv.in_size == 8 else d2)
        targets.append(filt[out_index][:, in_index])
        out_biases.append(bias[out_index])
    return Mapping(_channel_index(1, d4), _channel_index(1, d2), targets, out_biases)


def _group_tensor(tensor: torch.Tensor, field_type) -> Any:
    from equivariant.nn import GroupTensor

    return GroupTensor(tensor, field_type)


def coefficients_for(conv: SteerableConv2d, target: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Our coefficients whose expanded filter is closest to `target`, and the relative residual."""
    out_f, in_f, nb = conv.weight.shape
    blocks = target.reshape(out_f, conv.out_size, in_f, conv.in_size, -1).permute(0, 2, 1, 3, 4)
    blocks = blocks.reshape(out_f * in_f, -1).double()
    basis = conv.basis.reshape(nb, -1).double()
    coeffs = torch.linalg.lstsq(basis.T, blocks.T).solution.T
    residual = float((blocks - coeffs @ basis).norm() / blocks.norm())
    return coeffs.reshape(out_f, in_f, nb).float(), residual


def our_released_settings_model(standardize: bool, coordinates: str = CANONICAL_COORDINATES) -> nn.Module:
    """Our preset with the released recipe's model options; weight standardization off to load mapped filters, or
    on in the given coordinates ("escnn": the released code's)."""
    kwargs = dict(spec_of(load_recipe(RELEASED_RECIPE)).model_kwargs)
    if not standardize:
        kwargs["weight_standardization"] = False
    kwargs["standardization_coordinates"] = coordinates
    return equivariant_resnet9("D4", **kwargs).eval()


def load_mapping(ours: nn.Module, released: nn.Module, mapping: Mapping) -> list[dict[str, Any]]:
    """Our weights set to the released function; per layer the projection residual and the bias check."""
    rows = []
    with torch.no_grad():
        for name, conv, target, bias in zip(RELEASED_CONVS, our_convs(ours), mapping.targets, mapping.biases):
            coeffs, residual = coefficients_for(conv, target)
            conv.weight.copy_(coeffs)
            per_field = bias.reshape(conv.out_fields, conv.out_size)
            conv.bias.copy_(per_field[:, 0] / conv.bias_scale)
            spread = float((per_field - per_field[:, :1]).abs().max())
            rows.append({"layer": name, "span_residual": residual, "bias_spread_within_field": spread})
        head = ours.get_submodule("network.head.2")
        head.weight.copy_(released.classifier.weight)
        head.bias.copy_(released.classifier.bias)
    return rows


def randomize_biases(released: nn.Module, seed: int) -> nn.Module:
    """The released convs start with zero biases; random ones let the comparison see how each code adds them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for conv in released_convs(released):
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=generator))
    return refreshed(released)


def refreshed(released: nn.Module) -> nn.Module:
    """The released model in eval mode with its convs' cached filters and biases rebuilt from its parameters (its
    convs rebuild them only on a switch from train to eval mode)."""
    return released.train().eval()


def _stage_outputs(model: nn.Module, names: list[str], x: torch.Tensor, released: bool) -> dict[str, torch.Tensor]:
    outputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:
        module = model.get_submodule(name)

        def hook(_m, _i, out, name=name):
            outputs[name] = (out.tensor if released else out).detach()

        hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            outputs["logits"] = model(x).detach()
    finally:
        for h in hooks:
            h.remove()
    return outputs


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def parameter_counts(model: nn.Module, prefixes: list[str]) -> list[int]:
    """Parameters under each module prefix, in order."""
    return [sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix + ".")) for prefix in prefixes]


OUR_LAYERS = [
    "network.stem",
    "network.layer1",
    "network.res1.body.0",
    "network.res1.body.1",
    "network.layer2",
    "network.layer3",
    "network.res2.body.0",
    "network.res2.body.1",
    "network.head",
]


def our_parameter_counts() -> dict[str, int]:
    """Our side of the per-layer counts: the released recipe's model (the preset has the same counts)."""
    model = our_released_settings_model(standardize=True)
    return dict(zip(OUR_LAYERS, parameter_counts(model, OUR_LAYERS)))


def released_coordinates(released_conv: nn.Module, conv: SteerableConv2d, mapping: Mapping) -> torch.Tensor:
    """A with released_coefficients = our_coefficients @ A for one field pair: the checkout's R2Conv basis of the
    layer's first block (its weights 0..n-1) in our channel order, against ours (as escnn_coordinates for escnn)."""
    with torch.no_grad():
        unit = torch.eye(released_conv.basisexpansion.dimension())[: conv.num_basis]
        shape = (released_conv.out_type.size, released_conv.in_type.size, conv.kernel_size, conv.kernel_size)
        filters = torch.stack([released_conv.basisexpansion(e).reshape(shape) for e in unit])
    out_index = mapping.d4_index if conv.out_size == 8 else mapping.d2_index
    in_index = {1: torch.zeros(1, dtype=torch.long), 8: mapping.d4_index, 4: mapping.d2_index}[conv.in_size]
    block = filters[:, out_index][:, :, in_index].flatten(1).double()
    return torch.linalg.lstsq(block.T, conv.basis.flatten(1).double().T).solution.T


def compare_escnn_coordinates(
    released: nn.Module, standardized_targets: list[torch.Tensor], x: torch.Tensor, released_logits: torch.Tensor
) -> dict[str, Any]:
    """The released function (its standardization on) against ours standardizing in escnn's coordinates, loaded with
    the released raw coefficients mapped onto ours: each conv's standardized filter against the released one, and
    the logits. Then each conv but conv4 given the coordinates of the checkout's own basis (its escnn fork's), and
    conv4 also the released standardized filter (its standardization off): what is left of the difference."""
    ours = our_released_settings_model(standardize=True, coordinates=ESCNN_COORDINATES)
    raw = map_released(released, ours, standardized=False)
    layers = load_mapping(ours, released, raw)
    convs, conv4 = our_convs(ours), RELEASED_CONVS.index("conv4")
    with torch.no_grad():
        logits = ours(x)
        for i, (row, conv, released_conv, target) in enumerate(
            zip(layers, convs, released_convs(released), standardized_targets)
        ):
            del row["bias_spread_within_field"]
            row["standardized_filter_relative_difference"] = relative_difference(conv.expand_filter(), target)
            if i == conv4:
                continue
            coordinates = released_coordinates(released_conv, conv, raw)
            signs = torch.linalg.solve(conv.standardization_coordinates.double(), coordinates)  # escnn's -> released
            row["released_basis_is_escnns_up_to_signs"] = bool(
                torch.allclose(signs.abs(), torch.eye(len(signs), dtype=signs.dtype), atol=1e-5)
            )
            row["released_basis_signs_flipped"] = int((signs.diagonal() < 0).sum())
            conv.standardization_coordinates, conv.standardization_coordinates_inverse = coordinate_change(
                coordinates, conv.num_basis
            )
            row["standardized_filter_relative_difference_in_released_coordinates"] = relative_difference(
                conv.expand_filter(), target
            )
        in_released_coordinates = ours(x)
        convs[conv4].weight_standardization = None
        convs[conv4].standardization_coordinates = convs[conv4].standardization_coordinates_inverse = None
        convs[conv4].weight.copy_(coefficients_for(convs[conv4], standardized_targets[conv4])[0])
        conv4_given = ours(x)
    return {
        "note": "our model standardizing in escnn's coordinates (standardization_coordinates='escnn', escnn "
        f"{escnn_version()}) with the released raw coefficients mapped onto ours, against the released model, "
        "standardization on in both. The released code's escnn fork expands the D4 layers with escnn's basis up to "
        "the signs of some basis filters (released_basis_signs_flipped), which it draws from numpy's generator when "
        "it builds the model (seeded here) and which change a layer's mean and so its standardization; its conv4 reads each restricted D4 field (8 channels) as one field, so its coordinates mix "
        "the coefficients of the two D2 fields ours reads it as, which one change of coordinates per field pair cannot "
        "express",
        "layers": layers,
        **_logit_differences(logits, released_logits),
        "released_coordinates": _logit_differences(in_released_coordinates, released_logits),
        "released_coordinates_conv4_given_the_released_filter": _logit_differences(conv4_given, released_logits),
    }


def _logit_differences(logits: torch.Tensor, released_logits: torch.Tensor) -> dict[str, float]:
    return {
        "logits_relative_difference": relative_difference(logits, released_logits),
        "logits_max_abs_difference": float((logits - released_logits).abs().max()),
    }


def escnn_version() -> str:
    from equiconvert._escnn_compat import import_escnn

    return import_escnn().__version__


def compare_models(root: Path, batch: int = 4, seed: int = 0) -> tuple[dict[str, Any], nn.Module, nn.Module]:
    """The released model against ours with its weights mapped: per-layer counts, mapping residuals, each stage's
    activations and the logits; then what our weight standardization does to the mapped coefficients, and the
    released function against ours standardizing in escnn's coordinates."""
    released = randomize_biases(released_model(root, seed), seed)
    ours = our_released_settings_model(standardize=False)
    mapping = map_released(released, ours)
    layers = load_mapping(ours, released, mapping)
    rel_counts = parameter_counts(released, [*RELEASED_CONVS, "classifier"])
    our_counts = parameter_counts(ours, OUR_LAYERS)
    for row, rc, oc in zip(layers, rel_counts, our_counts):
        row.update(released_params=rc, our_params=oc)
    layers.append({"layer": "classifier", "released_params": rel_counts[-1], "our_params": our_counts[-1]})
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    rel_out = _stage_outputs(released, [s for s, _ in STAGES], x, released=True)
    our_out = _stage_outputs(ours, [f"network.{o}" for _, o in STAGES], x, released=False)
    stages = []
    for i, (rel_name, our_name) in enumerate(STAGES):
        size_index = mapping.d4_index if i < 4 else mapping.d2_index
        fields = rel_out[rel_name].shape[1] // len(size_index)
        index = _channel_index(fields, size_index.tolist())
        difference = relative_difference(our_out[f"network.{our_name}"], rel_out[rel_name][:, index])
        stages.append({"released": rel_name, "ours": our_name, "relative_difference": difference})
    logits_diff = relative_difference(our_out["logits"], rel_out["logits"])
    standardized = our_released_settings_model(standardize=True)
    standardized.load_state_dict(ours.state_dict())
    with torch.no_grad():
        ws_logits = standardized(x)
    ws_layers = [
        {"layer": name, "relative_change": relative_difference(conv.coefficients().detach(), conv.weight.detach())}
        for name, conv in zip(RELEASED_CONVS, our_convs(standardized))
    ]
    summary = {
        "released_params": sum(p.numel() for p in released.parameters()),
        "our_params": sum(p.numel() for p in ours.parameters()),
        "layers": layers,
        "channel_permutation_d4": mapping.d4_index.tolist(),
        "channel_permutation_d2": mapping.d2_index.tolist(),
        "stages": stages,
        "logits_relative_difference": logits_diff,
        "logits_max_abs_difference": float((our_out["logits"] - rel_out["logits"]).abs().max()),
        "equal": logits_diff < 1e-4,
        "our_standardization_on_mapped_weights": {
            "note": "the released code standardizes escnn's coefficients, ours our orthonormal basis' coefficients: "
            "the released filters, standardized again in our coordinates",
            "layers": ws_layers,
            "logits_relative_difference": relative_difference(ws_logits, rel_out["logits"]),
        },
        "escnn_coordinates": compare_escnn_coordinates(released, mapping.targets, x, rel_out["logits"]),
    }
    return summary, released, ours
