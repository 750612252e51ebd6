"""benchmarks/dp_memory.py: the ratios to Opacus, and the JSON of a --tiny run (an engine in its own subprocess)."""

import json
import math

from tests.support.benchmark_scripts import load_benchmark


def test_ratios_are_each_engines_step_peak_over_opacus():
    dp_memory = load_benchmark("dp_memory")
    results = dp_memory.with_ratios(
        {
            "ghost": {"engine_peak_mib": 50.0},
            "opacus_hooks": {"engine_peak_mib": 100.0},
            "opacus_ghost": {"not_run": "x"},
        }
    )
    assert results["ghost"]["ratio_to_opacus_hooks"] == 0.5
    assert "ratio_to_opacus_ghost" not in results["ghost"]


def test_tiny_run_writes_json(tmp_path):
    dp_memory = load_benchmark("dp_memory")
    out = tmp_path / "dp_memory.json"
    engines = ("ghost", "make_private_ghost")
    assert dp_memory.main(["--tiny", "--device", "cpu", "--engines", ",".join(engines), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "TinyNet -> C4" and report["batch"] == 4
    for engine in engines:
        record = report["engines"][engine]
        # a tiny engine's memory is within the resident set's noise (freed pages can take it below zero): the
        # engine ran and was measured, its size is for the full-size run
        assert math.isfinite(record["engine_peak_mib"]) and record["process_peak_mib"] > 0, record
        assert record["measured_by"].startswith(("VmHWM", "ru_maxrss")), record
