"""The order of the test files for `make test`'s workers (tests/schedule.py): longest first."""

from __future__ import annotations

from tests.schedule import MEASURED, PER_TEST, costs, longest_first
from tests.support import REPO


def test_every_measured_file_exists() -> None:
    assert [path for path in MEASURED if not (REPO / path).is_file()] == []


def test_every_folder_with_a_cost_of_its_own_exists() -> None:
    assert [p for p in PER_TEST if p and not (REPO / p).is_dir()] == []


def test_a_measured_file_costs_its_seconds_and_another_its_tests_at_its_folders_rate() -> None:
    nodeids = [
        "tests/chaos/test_chaos.py::test_short_profile",
        "tests/unit/test_a.py::test_one",
        "tests/unit/test_a.py::test_two",
        "tests/integration/test_b.py::test_one",
    ]
    assert costs(nodeids) == {
        "tests/chaos/test_chaos.py": MEASURED["tests/chaos/test_chaos.py"],
        "tests/unit/test_a.py": 2 * PER_TEST[""],
        "tests/integration/test_b.py": PER_TEST["tests/integration/"],
    }


def test_files_run_longest_first_each_keeping_its_own_order() -> None:
    nodeids = [
        "tests/unit/test_a.py::test_one",
        "tests/unit/test_a.py::test_two[1]",
        "tests/integration/test_b.py::test_one",
        "tests/unit/test_a.py::test_two[2]",
        "tests/unit/test_c.py::test_one",
        "tests/chaos/test_chaos.py::test_short_profile",
        "tests/unit/test_c.py::test_two",
    ]
    ordered = [nodeids[i] for i in longest_first(nodeids)]
    assert ordered == [
        "tests/chaos/test_chaos.py::test_short_profile",
        "tests/integration/test_b.py::test_one",
        "tests/unit/test_a.py::test_one",
        "tests/unit/test_a.py::test_two[1]",
        "tests/unit/test_a.py::test_two[2]",
        "tests/unit/test_c.py::test_one",
        "tests/unit/test_c.py::test_two",
    ]


def test_equal_costs_keep_the_collected_order() -> None:
    nodeids = ["tests/unit/test_z.py::test_one", "tests/unit/test_a.py::test_one"]
    assert longest_first(nodeids) == [0, 1]
