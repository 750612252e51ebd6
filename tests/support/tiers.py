"""Test tiers: markers given centrally, by where a test lies and by how long it last took.

`pytest -m "not slow"` is the everyday tier; a run without -m runs everything. A test is `slow` when
tests/durations.json records it at SLOW_SECONDS or more (setup, call and teardown together) or when it
carries the marker itself. `pytest --record-durations` measures the tests it runs and rewrites that file,
so the tiers follow the suite as it changes.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import pytest

DURATIONS_FILE = Path(__file__).resolve().parents[1] / "durations.json"
SLOW_SECONDS = 2.0  # a test that takes this long or longer is left out of the fast tier
RECORD_FLOOR_SECONDS = 0.5  # shorter tests are not written to the file: it lists what may become slow

# node id prefix -> marker: every prefix a test's node id starts with adds its marker
PATH_MARKERS: dict[str, str] = {
    "tests/benchmarks/": "benchmarks",
    "tests/convert/zoo/": "zoo",
    "tests/bases/test_escnn.py": "escnn",
    "tests/nn/test_escnn_coordinates.py": "escnn",
    "tests/bases/test_basis.py::test_escnn_joblib_cache": "escnn",
    "tests/bases/test_dilation.py::test_relation_to_escnns_dilated_span": "escnn",
    "tests/core/test_groups.py::test_action_matches_escnn": "escnn",
    "tests/nn/test_continuous_groups.py::test_field_matrices_match_escnn": "escnn",
    "tests/training/test_distributed.py": "distributed",
    "tests/benchmarks/test_distributed_smoke.py": "distributed",
}


def load_durations(path: Path = DURATIONS_FILE) -> dict[str, float]:
    """The recorded seconds per node id; none when the file is absent (every test is then in the fast tier)."""
    if not path.is_file():
        return {}
    return {str(node): float(seconds) for node, seconds in json.loads(path.read_text()).items()}


def markers_for(node_id: str, durations: Mapping[str, float]) -> set[str]:
    """The tier markers of one test: those of the prefixes it lies under, and `slow` when recorded as slow."""
    markers = {marker for prefix, marker in PATH_MARKERS.items() if node_id.startswith(prefix)}
    if durations.get(node_id, 0.0) >= SLOW_SECONDS:
        markers.add("slow")
    return markers


def merged_durations(recorded: Mapping[str, float], measured: Mapping[str, float]) -> dict[str, float]:
    """`recorded` updated by this run: a measured test replaces its entry (or drops it when under the floor)."""
    merged = {node: seconds for node, seconds in recorded.items() if node not in measured}
    merged.update({node: round(s, 2) for node, s in measured.items() if s >= RECORD_FLOOR_SECONDS})
    return dict(sorted(merged.items()))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help=f"measure the tests run and rewrite {DURATIONS_FILE.name} (the slow tier) with their durations",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    durations = load_durations()
    for item in items:
        for marker in sorted(markers_for(item.nodeid, durations)):
            item.add_marker(marker)


_measured: defaultdict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _measured[report.nodeid] += report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.getoption("--record-durations") and _measured:
        merged = merged_durations(load_durations(), _measured)
        DURATIONS_FILE.write_text(json.dumps(merged, indent=1) + "\n")
