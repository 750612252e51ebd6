"""`equiconvert audit` checks each numeric flag on its own and names it, before reading any data."""

from __future__ import annotations

import pytest

from equiconvert.cli import main
from equiconvert.cli.audit import FLAG_RULES


@pytest.mark.parametrize(
    "flag,value,rule",
    [
        ("--max-grad-norm", "-1", "clipping norm > 0"),
        ("--max-grad-norm", "inf", "clipping norm > 0"),
        ("--epsilon", "0", "privacy budget > 0"),
        ("--noise-multiplier", "0", "sigma > 0"),
        ("--delta", "1", "in (0, 1)"),
        ("--steps", "0", "at least 1 step"),
        ("--batch-size", "0", "at least 1"),
        ("--lr", "nan", "learning rate > 0"),
        ("--canaries", "1", "at least 2"),
    ],
)
def test_a_bad_flag_is_refused_by_name(tmp_path, capsys, monkeypatch, flag, value, rule):
    import equiconvert.data

    def no_data(*args, **kwargs):
        raise AssertionError("the data set was read before the flags were checked")

    monkeypatch.setattr(equiconvert.data, "load_dataset", no_data)
    out = tmp_path / "a"
    assert main(["audit", "--out", str(out), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} ")
    assert rule in err and "aug_mult" not in err and "target_epsilon" not in err and "noise_multiplier" not in err
    assert not out.exists()


def test_every_rule_names_a_flag_of_the_parser(tmp_path, capsys):
    for flag in FLAG_RULES:
        assert main(["audit", "--out", str(tmp_path / "a"), flag, "-3"]) == 2
        assert capsys.readouterr().err.startswith(f"error: {flag} -3")
