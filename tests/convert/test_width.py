"""Width policies resolve from one registry of names; a bad width is refused by name before any conversion."""

import pytest

from equiconvert.conversion_options import WIDTH_NAMES
from equiconvert.convert.width import (
    DEFAULT_WIDTH,
    PAPER_KAPPA,
    PARAMS,
    WIDTHS,
    channels_width,
    resolve_width,
)
from equiconvert.groups import parse_group


def test_every_width_name_resolves_to_its_registry_entry_and_none_to_the_default():
    assert tuple(WIDTHS) == WIDTH_NAMES == ("kappa", "params", "channels") and DEFAULT_WIDTH in WIDTHS
    for name, policy in WIDTHS.items():
        assert resolve_width(name) is policy
    assert resolve_width(None) is WIDTHS[DEFAULT_WIDTH]
    assert resolve_width(PARAMS) == "params" and resolve_width("channels") is channels_width
    d4 = parse_group("D4")  # |G| = 8: floor(64 sqrt(1.75*8)/8) = 29
    assert PAPER_KAPPA == 1.75 and resolve_width("kappa")(64, d4) == 29 == resolve_width(PAPER_KAPPA)(64, d4)
    assert resolve_width(1.5)(64, d4) == 27


@pytest.mark.parametrize("width", [0, -1.5, float("nan"), float("inf")])
def test_a_kappa_that_is_not_a_finite_positive_number_is_refused(width):
    with pytest.raises(ValueError, match="width kappa must be a finite number > 0"):
        resolve_width(width)


@pytest.mark.parametrize("width", ["wide", True, object()])
def test_an_unknown_width_names_the_known_ones(width):
    with pytest.raises(ValueError, match=r"unknown width policy.*'channels', 'kappa', 'params'"):
        resolve_width(width)
