"""The test tiers: markers given by path and by recorded duration, a durations file that names real tests."""

import json

import pytest

from tests.support import tiers
from tests.support.paths import REPO_ROOT


def test_markers_follow_the_path_and_the_recorded_duration():
    durations = {"tests/core/test_a.py::test_long": tiers.SLOW_SECONDS, "tests/core/test_a.py::test_short": 0.9}
    assert tiers.markers_for("tests/core/test_a.py::test_long", durations) == {"slow"}
    assert tiers.markers_for("tests/core/test_a.py::test_short", durations) == set()
    assert tiers.markers_for("tests/core/test_a.py::test_never_recorded", durations) == set()
    assert tiers.markers_for("tests/benchmarks/test_distributed_smoke.py::test_x", {}) == {"benchmarks", "distributed"}
    assert tiers.markers_for("tests/core/test_groups.py::test_action_matches_escnn[C4]", {}) == {"escnn"}


def test_recording_replaces_what_was_measured_and_keeps_the_rest():
    recorded = {"t::kept": 9.0, "t::faster": 8.0, "t::now_short": 3.0}
    measured = {"t::faster": 2.504, "t::now_short": 0.1, "t::new": 4.0}
    assert tiers.merged_durations(recorded, measured) == {"t::faster": 2.5, "t::kept": 9.0, "t::new": 4.0}


def test_every_tier_marker_is_registered(pytestconfig):
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert set(tiers.PATH_MARKERS.values()) | {"slow"} <= registered


def test_the_durations_file_names_test_files_that_exist():
    durations = json.loads(tiers.DURATIONS_FILE.read_text())
    assert durations and all(seconds >= tiers.RECORD_FLOOR_SECONDS for seconds in durations.values())
    missing = {node.split("::")[0] for node in durations} - {
        str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "tests").rglob("test_*.py")
    }
    assert not missing, f"tests/durations.json names files that are gone: {sorted(missing)}; rerun --record-durations"


def test_the_collection_hook_marks_the_tests_of_this_session(request, pytestconfig, monkeypatch):
    """The plugin is loaded by tests/conftest.py and its hook marks a real item by the durations file."""
    assert pytestconfig.pluginmanager.has_plugin("tests.support.tiers")
    assert request.node.get_closest_marker("slow") is None
    monkeypatch.setattr(tiers, "load_durations", lambda: {request.node.nodeid: tiers.SLOW_SECONDS})
    tiers.pytest_collection_modifyitems(pytestconfig, [request.node])
    assert request.node.get_closest_marker("slow") is not None


@pytest.mark.parametrize("prefix", sorted(tiers.PATH_MARKERS))
def test_every_path_marker_names_a_place_that_exists(prefix):
    path = prefix.split("::")[0]
    assert (REPO_ROOT / path).exists(), f"{prefix} in tests/support/tiers.py names nothing"
