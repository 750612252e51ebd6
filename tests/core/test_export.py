"""equiconvert.export: converted models -> plain torch.nn layers with the same outputs."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

import equiconvert
from equiconvert.errors import UnsupportedLayerError
from equiconvert.export import EXPORTERS, register_exporter
from equiconvert.models import resnet9
from equiconvert.nn import FieldGroupNorm, GroupPool, SteerableConv2d

TOLERANCE = 1e-6  # max abs difference / max abs output


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach(), expected.detach()
    return float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def foreign_classes(module: nn.Module) -> set[str]:
    """Classes of `module` that do not come from torch (the export must leave none)."""
    classes = {type(m) for m in module.modules()}
    return {f"{c.__module__}.{c.__qualname__}" for c in classes if not c.__module__.startswith("torch.")}


def _torchvision(name: str) -> nn.Module:
    import torchvision

    return getattr(torchvision.models, name)(num_classes=10)


def _timm(name: str) -> nn.Module:
    import timm

    return timm.create_model(name, num_classes=10)


MODELS = {
    "resnet9-D4": (lambda: resnet9(num_classes=10), "D4", "invariant"),
    "resnet9-C4": (lambda: resnet9(num_classes=10), "C4", "invariant"),
    "resnet18-D4": (lambda: _torchvision("resnet18"), "D4", None),
    "mobilenet_v2-C4": (lambda: _torchvision("mobilenet_v2"), "C4", None),
    "densenet121-D4": (lambda: _torchvision("densenet121"), "D4", None),
    "vgg11_bn-D4": (lambda: _torchvision("vgg11_bn"), "D4", "invariant"),
    "resnet50d-C4": (lambda: _timm("resnet50d"), "C4", None),
    "resnet50-D4": (lambda: _torchvision("resnet50"), "D4", None),
    "wide_resnet50_2-C4": (lambda: _torchvision("wide_resnet50_2"), "C4", None),
    "timm_resnet18-D4": (lambda: _timm("resnet18"), "D4", None),
}


@functools.lru_cache(maxsize=None)
def converted(name: str) -> tuple[equiconvert.EquivariantModel, nn.Module, torch.Tensor]:
    """(converted model, its export, an input at its default valid size); built once per test session."""
    build, group, head = MODELS[name]
    torch.manual_seed(0)
    model = equiconvert.make_equivariant(build(), group, head=head).eval()
    size = model.default_input_size()
    x = torch.randn(2, model.in_channels, size, size)
    return model, equiconvert.export(model), x


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("densenet") else n for n in MODELS]
)
def test_converted_model_exports_exactly(name: str) -> None:
    model, exported, x = converted(name)
    assert isinstance(exported, fx.GraphModule) and not isinstance(exported, equiconvert.EquivariantModel)
    assert not exported.training
    assert foreign_classes(exported) == set()
    assert any(isinstance(m, nn.Conv2d) for m in exported.modules())
    with torch.no_grad():
        expected, got = model(x), exported(x)
    assert got.shape == expected.shape == (2, 10)
    assert relative_error(got, expected) <= TOLERANCE
    # the converted model itself is untouched: export works on a copy
    assert any(isinstance(m, SteerableConv2d) for m in model.modules())


@pytest.mark.parametrize("name", ["resnet9-D4", "resnet18-D4"])
def test_onnx_export(name: str, tmp_path: Path) -> None:
    import onnx

    _, exported, x = converted(name)
    path = tmp_path / f"{name}.onnx"
    torch.onnx.export(exported, (x,), str(path), dynamo=True)  # the default (dynamo) exporter works as is
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    ops = {node.op_type for node in proto.graph.node}
    assert "Conv" in ops
    assert not any("equiconvert" in node.domain for node in proto.graph.node)
    # onnx's numpy reference runtime (no onnxruntime needed) reproduces the outputs
    from onnx.reference import ReferenceEvaluator

    session = ReferenceEvaluator(proto)
    (got,) = session.run(None, {session.input_names[0]: x.numpy()})
    with torch.no_grad():
        expected = exported(x)
    assert relative_error(torch.from_numpy(got), expected) <= 1e-5  # another runtime: float32 rounding differs


def test_exported_model_loads_and_runs_without_equiconvert(tmp_path: Path) -> None:
    """Pickle the whole exported module, then load and run it where importing equiconvert fails."""
    _, exported, x = converted("resnet9-D4")
    with torch.no_grad():
        expected = exported(x)
    torch.save({"model": exported, "x": x, "expected": expected}, tmp_path / "model.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["equiconvert"] = None  # any import of equiconvert now raises ImportError
        import torch
        saved = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        with torch.no_grad():
            got = saved["model"](saved["x"])
        assert torch.equal(got, saved["expected"]), (got - saved["expected"]).abs().max()
        assert not any(name.startswith("equiconvert") for name in sys.modules if sys.modules[name] is not None)
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


# --- single layers -----------------------------------------------------------------


def _randomise_affine(norm: FieldGroupNorm) -> FieldGroupNorm:
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    return norm


@pytest.mark.parametrize("shape", [(3, 56, 5, 6), (3, 56), (3, 56, 7)])
def test_uneven_field_group_norm_exports_exactly(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    norm = _randomise_affine(FieldGroupNorm(7, 8, 3)).eval()
    exported = equiconvert.export(norm)
    assert isinstance(exported, fx.GraphModule)
    assert foreign_classes(exported) == set()
    # affine parameters stay one per field (fine-tuning keeps them tied), the group matrices are named buffers
    assert dict((k, tuple(v.shape)) for k, v in exported.named_parameters()) == {"weight": (7,), "bias": (7,)}
    assert {k: tuple(v.shape) for k, v in exported.named_buffers()} == {"to_groups": (7, 3), "to_fields": (3, 7)}
    x = torch.randn(*shape) * 3 + 1
    assert torch.equal(exported(x), norm(x))


def test_even_field_group_norm_exports_exactly() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 32, 5, 5) * 2 - 1
    affine = _randomise_affine(FieldGroupNorm(8, 4, 4, eps=1e-3))
    exported = equiconvert.export(affine)
    assert foreign_classes(exported) == set()
    assert any(isinstance(m, nn.GroupNorm) and m.num_groups == 4 for m in exported.modules())
    assert torch.equal(exported(x), affine(x))
    plain = FieldGroupNorm(8, 4, 2, affine=False, eps=1e-3)
    exported = equiconvert.export(plain)
    assert type(exported) is nn.GroupNorm and exported.num_groups == 2 and exported.eps == 1e-3
    assert torch.equal(exported(x), plain(x))


class _LeafTracer(fx.Tracer):
    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return isinstance(module, GroupPool) or super().is_leaf_module(module, qualified_name)


def _traced_with_shapes(module: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    """A GraphModule that calls `module` with recorded shapes, as converted networks do."""
    root = nn.Sequential(module)
    gm = fx.GraphModule(root, _LeafTracer().trace(root))
    ShapeProp(gm).propagate(x)
    return gm


POOL_LAYERS = {
    ("max", 4): nn.MaxPool3d,
    ("mean", 4): nn.AvgPool3d,
    ("norm", 4): nn.LPPool3d,
    ("max", 2): nn.MaxPool1d,
    ("mean", 2): nn.AvgPool1d,
    ("norm", 2): nn.LPPool1d,
}


@pytest.mark.parametrize("mode", ["max", "mean", "norm"])
@pytest.mark.parametrize("shape", [(2, 24, 5, 5), (2, 24)], ids=["4d", "2d"])
def test_group_pool_exports(mode: str, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    pool = GroupPool(6, 4, mode)
    x = torch.randn(*shape)
    x[0, 4:8] = 0.0  # an all-zero field: GroupPool's 'norm' gives sqrt(1e-12), not 0
    expected = pool(x)
    assert expected.shape == (2, 6, *shape[2:])

    # inside a traced graph with recorded shapes: Unflatten + nn pooling + Flatten
    exported = equiconvert.export(_traced_with_shapes(pool, x))
    assert foreign_classes(exported) == set()
    assert any(type(m) is POOL_LAYERS[mode, len(shape)] for m in exported.modules())
    got = exported(x)
    assert got.shape == expected.shape
    assert relative_error(got, expected) <= TOLERANCE
    if mode == "max":
        assert torch.equal(got, expected)
    if mode == "norm":
        assert torch.allclose(got[0, 1], torch.full_like(got[0, 1], 1e-6))
        x_grad = x.clone().requires_grad_()
        exported(x_grad).sum().backward()
        assert torch.isfinite(x_grad.grad).all()

    # on its own (input rank unknown): a traced torch-only reduction, bit-identical
    alone = equiconvert.export(pool)
    assert isinstance(alone, fx.GraphModule) and foreign_classes(alone) == set()
    assert torch.equal(alone(x), expected)


def _steerable(
    padding,
    padding_mode: str,
    *,
    groups: int = 1,
    stride: int = 1,
    dilation: int = 1,
    weight_standardization: bool = False,
) -> SteerableConv2d:
    torch.manual_seed(0)
    basis = torch.randn(5, 4, 4, 3, 3)  # any basis: export only needs the expanded filter
    conv = SteerableConv2d(
        basis,
        6,
        4,
        stride=stride,
        padding=padding,
        dilation=dilation,
        groups=groups,
        padding_mode=padding_mode,
        weight_standardization=weight_standardization,
    )
    with torch.no_grad():
        conv.bias.normal_()
    return conv


def test_steerable_conv_reflect_same_padding() -> None:
    conv = _steerable("same", "reflect", dilation=2)
    exported = equiconvert.export(conv)
    assert type(exported) is nn.Conv2d
    assert (exported.padding, exported.padding_mode, exported.dilation) == (
        (2, 2),
        "reflect",
        (2, 2),
    )  # "same" at dilation 2
    x = torch.randn(2, 24, 9, 9)
    pad = 2  # dilation * (kernel - 1) // 2
    reference = F.conv2d(F.pad(x, (pad,) * 4, mode="reflect"), conv.expand_filter(), conv.expand_bias(), 1, 0, 2)
    got = exported(x)
    assert got.shape == (2, 16, 9, 9)
    assert relative_error(got, reference) <= TOLERANCE


def test_steerable_conv_reflect_same_padding_forward() -> None:
    conv = _steerable("same", "reflect")
    x = torch.randn(2, 24, 9, 9)
    assert relative_error(equiconvert.export(conv)(x), conv(x)) <= TOLERANCE


@pytest.mark.parametrize(
    "padding, padding_mode, groups, stride, standardize",
    [
        (1, "reflect", 1, 1, False),
        ((1, 1), "circular", 2, 2, False),
        ("same", "zeros", 1, 1, True),
        ("valid", "zeros", 2, 1, False),
        (0, "replicate", 1, 2, True),
    ],
)
def test_steerable_conv_matches_forward(
    padding, padding_mode: str, groups: int, stride: int, standardize: bool
) -> None:
    conv = _steerable(padding, padding_mode, groups=groups, stride=stride, weight_standardization=standardize)
    exported = equiconvert.export(conv)
    assert type(exported) is nn.Conv2d and exported.groups == groups
    assert exported.weight.shape == conv.expand_filter().shape
    x = torch.randn(2, 24, 9, 9)
    with torch.no_grad():
        assert torch.equal(exported(x), conv(x))
    # weights are trainable like the source (expanded, so no longer tied to the basis)
    assert exported.weight.requires_grad and exported.bias.requires_grad


class _FakeEquiconvertLayer(nn.Module):
    """Looks like an equiconvert layer that nobody wrote an exporter for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


_FakeEquiconvertLayer.__module__ = "equiconvert.nn.fake"


def test_module_without_exporter_raises_naming_its_path() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.ReLU(), _FakeEquiconvertLayer()))
    with pytest.raises(UnsupportedLayerError, match=r"'1\.1'.*_FakeEquiconvertLayer.*register_exporter"):
        equiconvert.export(model)


def test_registered_exporter_is_used() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), _FakeEquiconvertLayer())

    @register_exporter(_FakeEquiconvertLayer)
    def _export_fake(module: nn.Module, ctx) -> nn.Module:
        assert ctx.path == "1"
        return nn.Identity()

    try:
        exported = equiconvert.export(model)
    finally:
        del EXPORTERS[_FakeEquiconvertLayer]
    assert type(exported[1]) is nn.Identity and type(model[1]) is _FakeEquiconvertLayer


def test_exported_uneven_field_group_norm_takes_an_empty_batch():
    model = equiconvert.make_equivariant(resnet9(widths=(8, 16, 32)), "D4", head="invariant").eval()
    plain = equiconvert.export(model).eval()
    assert plain(torch.randn(0, 3, 32, 32)).shape == (0, 10)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(plain(x), model(x))


@pytest.mark.parametrize("traced", [True, False], ids=["shapes", "no-shapes"])
def test_a_scaled_group_pool_exports_with_its_scale(traced: bool) -> None:
    pool = GroupPool(6, 4, "max", scale=0.5)
    x = torch.randn(2, 24, 5, 5)
    exported = equiconvert.export(_traced_with_shapes(pool, x) if traced else nn.Sequential(pool))
    assert foreign_classes(exported) == set()
    assert torch.equal(exported(x), pool(x)) and torch.equal(pool(x), 0.5 * GroupPool(6, 4, "max")(x))
