"""The test tiers: markers given by path and by recorded duration, a durations file that names real tests."""

import pytest

from tests.support import tiers
from tests.support.paths import REPO_ROOT

SLOW = tiers.SLOW_SECONDS


def test_markers_follow_the_path_and_the_recorded_duration():
    durations = tiers.Durations(
        tests={"tests/core/test_a.py::test_long": SLOW, "tests/core/test_a.py::test_short": 0.9}
    )
    assert tiers.markers_for("tests/core/test_a.py::test_long", [], durations) == {"slow"}
    assert tiers.markers_for("tests/core/test_a.py::test_short", [], durations) == set()
    assert tiers.markers_for("tests/core/test_a.py::test_never_recorded", [], durations) == set()
    empty = tiers.Durations()
    assert tiers.markers_for("tests/benchmarks/test_distributed_smoke.py::test_x", [], empty) == {
        "benchmarks",
        "distributed",
    }
    assert tiers.markers_for("tests/core/test_groups.py::test_action_matches_escnn[C4]", [], empty) == {"escnn"}


def test_a_test_using_a_slow_shared_fixture_of_its_module_is_slow():
    """Only the first test of a module pays for a module fixture: the others that use it are slow all the same."""
    durations = tiers.Durations(fixtures={"tests/core/test_a.py::job": SLOW, "tests/core/test_a.py::cheap": 0.6})
    assert tiers.markers_for("tests/core/test_a.py::test_reads_the_job", ["tmp_path", "job"], durations) == {"slow"}
    assert tiers.markers_for("tests/core/test_a.py::test_cheap", ["cheap"], durations) == set()
    assert tiers.markers_for("tests/core/test_b.py::test_own_job", ["job"], durations) == set()  # another module's


def test_recording_replaces_what_was_measured_and_keeps_the_rest():
    recorded = {"t::kept": 9.0, "t::faster": 8.0, "t::now_short": 3.0}
    measured = {"t::faster": 2.504, "t::now_short": 0.1, "t::new": 4.0}
    assert tiers.merged(recorded, measured) == {"t::faster": 2.5, "t::kept": 9.0, "t::new": 4.0}


def test_every_tier_marker_is_registered(pytestconfig):
    registered = {line.split(":")[0] for line in pytestconfig.getini("markers")}
    assert set(tiers.PATH_MARKERS.values()) | {"slow"} <= registered


def test_the_durations_file_names_test_files_that_exist():
    durations = tiers.load_durations()
    entries = {**durations.tests, **durations.fixtures}
    assert durations.tests and all(seconds >= tiers.RECORD_FLOOR_SECONDS for seconds in entries.values())
    files = {str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "tests").rglob("test_*.py")}
    missing = {key.split("::")[0] for key in entries} - files
    assert not missing, f"tests/durations.json names files that are gone: {sorted(missing)}; rerun --record-durations"


def test_the_collection_hook_marks_the_tests_of_this_session(request, pytestconfig, monkeypatch):
    """The plugin is loaded by tests/conftest.py and its hook marks a real item by the durations file."""
    assert pytestconfig.pluginmanager.has_plugin("tests.support.tiers")
    assert request.node.get_closest_marker("slow") is None
    monkeypatch.setattr(tiers, "load_durations", lambda: tiers.Durations(tests={request.node.nodeid: SLOW}))
    tiers.pytest_collection_modifyitems(pytestconfig, [request.node])
    assert request.node.get_closest_marker("slow") is not None


@pytest.fixture(scope="module")
def shared_value() -> int:
    return 1


def test_a_module_fixture_is_measured_under_its_module(shared_value):
    """The fixture hook keyed this module's fixture by the module's path (what markers_for looks up)."""
    assert shared_value == 1
    assert tiers.fixture_key("tests/package/test_tiers.py", "shared_value") in tiers._measured.fixtures


@pytest.mark.parametrize("prefix", sorted(tiers.PATH_MARKERS))
def test_every_path_marker_names_a_place_that_exists(prefix):
    path = prefix.split("::")[0]
    assert (REPO_ROOT / path).exists(), f"{prefix} in tests/support/tiers.py names nothing"
