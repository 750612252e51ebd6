"""canonicalize: exact invariance of models that keep their weights, the straight-through choice, the prior,
save/load, export and check_equivariance of the wrapped model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import equiconvert
from equiconvert.adapt import CanonicalizationError, CanonicalizedModel, canonicalize, pose_prior_loss
from equiconvert.adapt.canonicalize import straight_through_choice
from equiconvert.errors import GroupSpecError
from equiconvert.groups import parse_group

BACKBONES = {
    "torchvision resnet18": lambda: pytest.importorskip("torchvision").models.resnet18(weights=None, num_classes=5),
    "timm resnet10t": lambda: pytest.importorskip("timm").create_model("resnet10t", pretrained=False, num_classes=5),
}


def _invariance_error(model: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        y = model(x)
        return max(float((model(g.act_on_grid(x)) - y).abs().max()) for g in parse_group(model.group).grid_elements)


@pytest.mark.parametrize("group", ["C4", "D4"])
@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_wrapped_pretrained_models_are_exactly_invariant_and_keep_their_weights(backbone, group):
    torch.manual_seed(0)
    model = BACKBONES[backbone]().eval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    objects = {name: p for name, p in model.named_parameters()}
    wrapped = canonicalize(model, group).eval()
    assert wrapped.backbone is model
    for name, p in wrapped.backbone.named_parameters():
        assert p is objects[name] and torch.equal(p, before[name]), name
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not torch.allclose(model(x), model(torch.rot90(x, 1, (-2, -1))), atol=1e-5)  # the backbone is not
    assert _invariance_error(wrapped, x) <= 1e-5


def test_continuous_groups_are_refused_with_the_discrete_group_to_use():
    for group, use in (("SO2", "use C16"), ("O2", "use D16")):
        with pytest.raises(GroupSpecError, match=f"continuous.*{use}"):
            canonicalize(nn.Identity(), group)


def test_bad_arguments_and_inputs_are_refused_early():
    with pytest.raises(CanonicalizationError, match="kernel_size must be odd"):
        canonicalize(nn.Identity(), "C4", kernel_size=4)
    with pytest.raises(CanonicalizationError, match="temperature"):
        canonicalize(nn.Identity(), "C4", temperature=0.0)
    with pytest.raises(CanonicalizationError, match="torch.nn.Module"):
        canonicalize("resnet18", "C4")
    wrapped = canonicalize(nn.Identity(), "C4", pool=2)
    with pytest.raises(CanonicalizationError, match="square"):
        wrapped(torch.randn(1, 3, 12, 16))
    with pytest.raises(CanonicalizationError, match="pool=2"):
        wrapped(torch.randn(1, 3, 15, 15))


def test_the_input_reaches_the_backbone_in_its_canonical_pose():
    torch.manual_seed(0)
    wrapped = canonicalize(nn.Identity(), "D4").eval()
    x = torch.randn(3, 3, 16, 16)
    canonical = wrapped(x)
    for g in wrapped.elements:
        assert torch.equal(wrapped(g.act(x)), canonical), g.name  # bit for bit
    # the canonical pose is a pose of the input, the inverse of the chosen element's
    for image, out, name in zip(x, canonical, wrapped.poses(x)):
        element = next(g for g in wrapped.elements if g.name == name)
        assert torch.equal(element.act(out), image)


def test_straight_through_choice_is_one_hot_forward_and_softmax_backward():
    scores = torch.randn(4, 8, requires_grad=True)
    choice = straight_through_choice(scores, temperature=2.0)
    assert torch.equal(choice, F.one_hot(scores.argmax(-1), 8).float())
    weights = torch.randn(4, 8)
    (choice * weights).sum().backward()
    reference = scores.detach().clone().requires_grad_(True)
    (torch.softmax(reference / 2.0, -1) * weights).sum().backward()
    torch.testing.assert_close(scores.grad, reference.grad, rtol=0, atol=0)


def test_the_task_loss_trains_the_canonicaliser():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    wrapped = canonicalize(backbone, "C4").train()
    F.cross_entropy(wrapped(torch.randn(4, 3, 12, 12)), torch.tensor([0, 1, 2, 0])).backward()
    for name, p in wrapped.canonicalizer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_pose_prior_turns_upright_data_to_the_identity_pose():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2))
    wrapped = canonicalize(backbone, "C4").train()
    x = torch.randn(8, 3, 12, 12)
    x[:, :, :4] += 2.0  # "upright": bright at the top
    assert set(wrapped.poses(x)) != {"rot0"}
    loss_fn = pose_prior_loss(wrapped, weight=1.0, loss_fn=lambda logits, labels: 0 * logits.sum(-1))
    optimizer = torch.optim.SGD(wrapped.canonicalizer.parameters(), lr=0.5)
    for _ in range(30):
        optimizer.zero_grad()
        loss_fn(wrapped(x), torch.zeros(8, dtype=torch.long)).mean().backward()
        optimizer.step()
    assert set(wrapped.poses(x)) == {"rot0"}
    with pytest.raises(RuntimeError, match="no pose scores"):
        loss_fn(torch.zeros(8, 2), torch.zeros(8, dtype=torch.long))


def test_pose_prior_loss_needs_a_canonicalized_model():
    with pytest.raises(CanonicalizationError, match="no CanonicalizedModel"):
        pose_prior_loss(nn.Linear(2, 2))


def _registry_model() -> CanonicalizedModel:
    torch.manual_seed(0)
    return canonicalize(equiconvert.create_model("resnet9", num_classes=4), "D4", fields=1).eval()


def test_save_and_load_rebuild_the_wrapped_model(tmp_path):
    model = _registry_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # weights that differ from a fresh build
    equiconvert.save(model, tmp_path / "model.pt")
    loaded = equiconvert.load(tmp_path / "model.pt")
    assert isinstance(loaded, CanonicalizedModel) and loaded.group == model.group
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_export_gives_torch_only_modules_with_the_same_outputs():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    model = canonicalize(backbone, "D4", fields=1).eval()
    exported = equiconvert.export(model)
    names = {type(m).__module__.split(".")[0] for m in exported.modules()}
    assert "equiconvert" not in names
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(exported(x), model(x), rtol=0, atol=0)
        torch.testing.assert_close(exported(torch.rot90(x, 1, (-2, -1))), model(x), rtol=0, atol=1e-5)


def test_check_equivariance_measures_the_invariance_of_the_wrapped_model():
    model = _registry_model()
    result = equiconvert.check_equivariance(model, input_size=16)
    assert set(result.errors) == {g.name for g in parse_group("D4").grid_elements}
    assert result.max_error <= 1e-5
    broken = copy.deepcopy(model)
    broken.elements = tuple(reversed(broken.elements))  # undoing the wrong element: no longer invariant
    assert equiconvert.check_equivariance(broken, input_size=16).max_error > 1e-3
