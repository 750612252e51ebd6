"""The zoo: every torchvision classification CNN and 50+ timm CNNs (benchmarks/zoo_coverage.py lists them).

Each converts exactly (logits within 1e-5 under every C4 element at a size the report calls
valid), converts with a warning that no size is exact, or is refused with an UnsupportedLayerError
/ TracingError naming node, module and options: never a crash or a silent failure.
"""
import pytest

from benchmark_scripts import load_benchmark

zoo_coverage = load_benchmark("zoo_coverage")
FAST = ("ghostnet_050", "rexnet_100", "convnext_tiny (small widths)", "dla46_c", "mixnet_s", "tf_efficientnet_b0")


def _assert_clear(record) -> None:
    assert record.outcome != "crash", (record.architecture, record.message)
    if record.outcome == "refused":
        assert "cannot convert node" in record.message and "Options" in record.message or \
            "could not trace" in record.message and "module" in record.message, record.message
    if record.outcome == "no-exact":
        assert "no size from 8" in record.message and record.params_after > 0
    if record.outcome == "exact":
        assert record.max_error <= zoo_coverage.TOLERANCE and record.checked_size in range(8, 1025)


@pytest.mark.parametrize("name", FAST)
def test_zoo_sample_converts_exactly_or_fails_clearly(name):
    (entry,) = [e for e in zoo_coverage.zoo([name]) if e[0] == "timm"]
    _assert_clear(zoo_coverage.assess(*entry))


def test_zoo_lists_enough_architectures():
    assert len(zoo_coverage.TIMM) >= 40 and len(zoo_coverage.TORCHVISION) >= 15


@pytest.mark.slow
def test_whole_zoo_has_no_crash_and_most_timm_models_convert_exactly():
    records = [zoo_coverage.assess(*entry) for entry in zoo_coverage.zoo()]
    for record in records:
        _assert_clear(record)
    timm = [r for r in records if r.source == "timm"]
    exact = sum(r.outcome == "exact" for r in timm)
    assert exact >= 0.85 * len(timm), [(r.architecture, r.outcome) for r in timm if r.outcome != "exact"]
