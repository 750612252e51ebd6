"""A head that flattens a spatial grid: averaged over the group's turns and flips by default (exactly invariant, the
Linear keeps its shape), kept as it is in mode "dp" (reported as not invariant), pooled globally on request."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import equiconvert
from equiconvert.export import export
from equiconvert.nn import GridSymmetrize, GroupPool


def flatten_head_cnn() -> nn.Module:
    """Tramèr & Boneh's pattern in small: convs, a pool, then the whole 4x4 map flattened into a Linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.Tanh(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def test_the_default_head_makes_a_flattened_grid_exactly_invariant_and_the_linear_reads_every_cell():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = equiconvert.make_equivariant(flatten_head_cnn(), "D4", input_size=16)
    assert not [w for w in caught if "flattens" in str(w.message)]
    assert "output: invariant" in str(model.report)
    assert equiconvert.check_equivariance(model, input_size=16).max_error < 1e-5
    symmetrize = [m for m in model.modules() if isinstance(m, GridSymmetrize)]
    assert len(symmetrize) == 1 and len(symmetrize[0].actions) == 8  # D4's eight grid actions
    (pool,) = [m for m in model.modules() if isinstance(m, GroupPool)]
    linear = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    assert linear.in_features == pool.num_fields * 4 * 4  # one invariant channel per field, at every cell


def test_mode_dp_keeps_the_grids_cells_and_says_the_output_is_not_invariant():
    with pytest.warns(Warning, match="flattens a 4x4 grid"):
        model = equiconvert.make_equivariant(flatten_head_cnn(), "D4", input_size=16, mode="dp")
    assert not any(isinstance(m, GridSymmetrize) for m in model.modules())
    assert equiconvert.check_equivariance(model, input_size=16).max_error > 1e-3


def test_a_symmetric_head_exports_to_plain_torch_with_the_same_outputs():
    model = equiconvert.make_equivariant(flatten_head_cnn(), "C4", input_size=16, head="symmetric").eval()
    plain = export(model).eval()
    assert not any(isinstance(m, GridSymmetrize) for m in plain.modules())
    x = torch.randn(3, 3, 16, 16)
    torch.testing.assert_close(plain(x), model(x), rtol=0, atol=1e-6)


def test_grid_symmetrize_averages_each_orbit_of_cells():
    corners_then_rest = torch.arange(16.0).view(1, 1, 4, 4)
    turns = GridSymmetrize([(k, False) for k in range(4)])(corners_then_rest)
    corners = turns[0, 0, [0, 0, 3, 3], [0, 3, 0, 3]]
    assert torch.equal(corners, torch.full((4,), (0 + 3 + 12 + 15) / 4))  # one orbit under C4: one value
    assert torch.equal(GridSymmetrize([(0, False)])(corners_then_rest), corners_then_rest)  # the trivial group
