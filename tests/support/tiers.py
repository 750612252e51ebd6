"""Test tiers: markers given centrally, by where a test lies and by how long it last took.

`pytest -m "not slow"` is the everyday tier; a run without -m runs everything. A test is `slow` when
tests/durations.json records it at SLOW_SECONDS or more (setup, call and teardown together), when it uses a
module- or class-scoped fixture recorded there as slow to build (whichever test of the module builds it first
pays for it), or when it carries the marker itself. `pytest --record-durations` measures what it runs and
rewrites that file (an interrupted run writes what it measured), so the tiers follow the suite as it changes.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DURATIONS_FILE = Path(__file__).resolve().parents[1] / "durations.json"
SLOW_SECONDS = 2.0  # a test (or a shared fixture) that takes this long or longer is left out of the fast tier
RECORD_FLOOR_SECONDS = 0.5  # shorter tests are not written to the file: it lists what may become slow
SHARED_SCOPES = ("module", "class")  # fixtures built once for several tests of one module

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


@dataclass(frozen=True)
class Durations:
    """Seconds per test node id, and per shared fixture as "<test module>::<fixture name>"."""

    tests: dict[str, float] = field(default_factory=dict)
    fixtures: dict[str, float] = field(default_factory=dict)


def load_durations(path: Path = DURATIONS_FILE) -> Durations:
    """The recorded seconds; none when the file is absent (every test is then in the fast tier)."""
    if not path.is_file():
        return Durations()
    recorded = json.loads(path.read_text())
    return Durations(dict(recorded.get("tests", {})), dict(recorded.get("fixtures", {})))


def fixture_key(module: str, name: str) -> str:
    return f"{module}::{name}"


def markers_for(node_id: str, fixture_names: Iterable[str], durations: Durations) -> set[str]:
    """The tier markers of one test: those of the prefixes it lies under; `slow` when it or a shared fixture it
    uses is recorded as slow."""
    markers = {marker for prefix, marker in PATH_MARKERS.items() if node_id.startswith(prefix)}
    module = node_id.split("::")[0]
    shared = (durations.fixtures.get(fixture_key(module, name), 0.0) for name in fixture_names)
    if durations.tests.get(node_id, 0.0) >= SLOW_SECONDS or max(shared, default=0.0) >= SLOW_SECONDS:
        markers.add("slow")
    return markers


def merged(recorded: Mapping[str, float], measured: Mapping[str, float]) -> dict[str, float]:
    """`recorded` updated by this run: a measured entry replaces its own (or drops it when under the floor)."""
    kept = {key: seconds for key, seconds in recorded.items() if key not in measured}
    kept.update({key: round(s, 2) for key, s in measured.items() if s >= RECORD_FLOOR_SECONDS})
    return dict(sorted(kept.items()))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help=f"measure the tests run and rewrite {DURATIONS_FILE.name} (the slow tier) with their durations",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    durations = load_durations()
    for item in items:
        for marker in sorted(markers_for(item.nodeid, getattr(item, "fixturenames", []), durations)):
            item.add_marker(marker)


_measured = Durations(defaultdict(float), {})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _measured.tests[report.nodeid] += report.duration


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    start = time.perf_counter()
    try:
        return (yield)
    finally:
        if fixturedef.scope in SHARED_SCOPES:
            module = request.node.nodeid.split("::")[0]
            _measured.fixtures[fixture_key(module, fixturedef.argname)] = time.perf_counter() - start


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.getoption("--record-durations") and _measured.tests:
        recorded = load_durations()
        content = {
            "tests": merged(recorded.tests, _measured.tests),
            "fixtures": merged(recorded.fixtures, _measured.fixtures),
        }
        DURATIONS_FILE.write_text(json.dumps(content, indent=1) + "\n")
