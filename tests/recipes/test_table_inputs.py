"""benchmarks/accuracy.py table: --gpus and --time-limit are checked before any run starts."""

from __future__ import annotations

import pytest

from tests.recipes.test_table import PASS_THROUGH, _tiny_table, accuracy, tables


@pytest.fixture
def started(monkeypatch):
    """The runs that reached `execute` (which trains nothing here)."""
    calls: list[str] = []
    monkeypatch.setattr(tables, "execute", lambda name, *args, **kwargs: calls.append(name))
    return calls


@pytest.mark.parametrize(
    "gpus,message",
    [("x,y", "--gpus x,y: give comma-separated card indices"), ("0,-1", "not '-1'"), ("1,1", "lists card 1 twice")],
)
def test_gpus_must_be_card_indices(tmp_path, started, gpus, message):
    argv = ["table", str(_tiny_table(tmp_path)), "--out", str(tmp_path / "out"), "--gpus", gpus]
    with pytest.raises(SystemExit, match=message):
        accuracy.main([*argv, "--", *PASS_THROUGH])
    assert started == []
    assert [s.env for s in tables.table_slots(["0", "3"], 1, None)] == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "3"},
    ]


@pytest.mark.parametrize("limit", ["-5", "0", "nan", "inf", "soon"])
def test_time_limit_must_be_positive(tmp_path, capsys, started, limit):
    out = tmp_path / "out"
    argv = ["table", str(_tiny_table(tmp_path)), "--out", str(out), "--time-limit", limit]
    with pytest.raises(SystemExit):
        accuracy.main([*argv, "--", *PASS_THROUGH])
    err = capsys.readouterr().err
    assert "argument --time-limit: give a" in err and "number of seconds" in err
    assert started == [] and not out.exists()
