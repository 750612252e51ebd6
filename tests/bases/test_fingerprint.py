"""Checkpoints know their bases: fingerprints in the state_dict, mismatch errors, re-expressing old coefficients."""

import io
import math

import pytest
import torch

from equiconvert.errors import UnreadableFileError
from equiconvert.bases.canonical import BasisMismatchError, basis_fingerprint, reexpress_coefficients
from equiconvert.nn.reexpress import legacy_bases, reexpress_state_dict
from equiconvert.basis import steerable_basis
from equiconvert.groups import parse_group
from equiconvert.nn.conv import SteerableConv2d


def _layer(basis=None, seed=0):
    torch.manual_seed(seed)
    basis = steerable_basis(parse_group("D4"), "regular", "regular", 3, cutoff=3.0) if basis is None else basis
    return torch.nn.Sequential(SteerableConv2d(basis, 2, 3, padding=1))


def _rotated_within_span(basis, seed=1):
    n = basis.shape[0]
    mixing = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)).Q
    return torch.einsum("mn,n...->m...", mixing, basis.double()).float()


def test_state_dict_carries_a_weights_only_loadable_fingerprint():
    model = _layer()
    state = model.state_dict()
    assert state["0._extra_state"].dtype == torch.uint8
    assert bytes(state["0._extra_state"].tolist()).hex() == model[0].basis_fingerprint
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh = _layer(seed=5)
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_loading_coefficients_of_another_basis_is_an_error():
    model = _layer()
    other = _layer(_rotated_within_span(model[0].basis))  # same span, other basis: other filters
    assert other[0].basis_fingerprint != model[0].basis_fingerprint
    with pytest.raises(BasisMismatchError, match=r"^0: the state_dict was saved with a kernel basis of fingerprint"):
        other.load_state_dict(model.state_dict())


def test_fingerprint_ignores_precision_but_not_order_or_sign():
    basis = steerable_basis(parse_group("C4"), "trivial", "regular", 3)
    assert basis_fingerprint(basis.double()) == basis_fingerprint(basis)
    assert basis_fingerprint(basis[[1, 0, *range(2, len(basis))]]) != basis_fingerprint(basis)
    assert basis_fingerprint(-basis) != basis_fingerprint(basis)


def test_old_checkpoint_loads_with_warning_and_is_reexpressed_exactly():
    old_basis = _rotated_within_span(steerable_basis(parse_group("D4"), "regular", "regular", 3, cutoff=3.0), seed=3)
    old_model = _layer(old_basis, seed=2)
    old_state = {k: v for k, v in old_model.state_dict().items() if not k.endswith("_extra_state")}
    x = torch.randn(2, 16, 9, 9)
    expected = old_model(x)

    model = _layer(seed=7)
    with pytest.warns(UserWarning, match="no basis fingerprint.*reexpress_state_dict"):
        model.load_state_dict(old_state)
    assert not torch.allclose(model(x), expected, atol=1e-3)  # read as-is, the coefficients are another network

    converted = reexpress_state_dict(model, old_state, {"0": old_basis})
    model.load_state_dict(converted)  # fingerprint now matches: no warning, no error
    assert torch.allclose(model(x), expected, atol=1e-4)


def test_legacy_bases_found_in_an_old_cache_directory(tmp_path):
    current = steerable_basis(parse_group("D4"), "regular", "regular", 3, cutoff=3.0)
    torch.save(_rotated_within_span(current), tmp_path / "D4_regular_regular_k3_d1_fco3.pt")
    other_span = torch.randn(current.shape, generator=torch.Generator().manual_seed(4))
    torch.save(other_span, tmp_path / "D4_regular_regular_k3_fco3_other.pt")  # same shape, another span
    model = _layer()
    found = legacy_bases(model, tmp_path)
    assert torch.equal(found["0"], torch.load(tmp_path / "D4_regular_regular_k3_d1_fco3.pt", weights_only=True))
    (tmp_path / "D4_regular_regular_k3_d1_fco3.pt").unlink()
    with pytest.raises(FileNotFoundError, match="0: no basis of shape"):
        legacy_bases(model, tmp_path)
    (tmp_path / "damaged.pt").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(UnreadableFileError, match=r"damaged\.pt: not readable as a basis file.*remove it"):
        legacy_bases(model, tmp_path)


def test_reexpress_is_least_squares_and_exact_on_equal_spans():
    basis = steerable_basis(parse_group("C4"), "regular", "regular", 3)
    other = _rotated_within_span(basis)
    weight = torch.randn(3, 2, basis.shape[0])
    new = reexpress_coefficients(weight, basis, other)
    filters = lambda w, b: w.double() @ b.double().reshape(b.shape[0], -1)  # noqa: E731
    assert torch.allclose(filters(new, other), filters(weight, basis), atol=1e-5)


def test_init_gives_the_intended_filter_scale_with_orthonormal_bases():
    """Each output channel's expanded filter has squared norm init_gain^2 on average (std gain/sqrt(fan-in))."""
    basis = steerable_basis(parse_group("D4"), "regular", "regular", 3, cutoff=3.0)
    torch.manual_seed(0)
    conv = SteerableConv2d(basis, 32, 32, init_gain=math.sqrt(2.0))
    rows = conv.expand_filter().pow(2).sum(dim=(1, 2, 3))
    assert abs(rows.mean().item() - 2.0) < 0.1
