"""The order in which `make test`'s workers take the test files: the longest first.

pytest-xdist's ``--dist loadfile`` hands out whole files, in the collection's order unless it
reorders them, and by default it does: most tests first. That put the chaos profile's file (one
test of minutes) among the last handed out, and a run then ended minutes after the rest, on one
worker. So the suite orders its files itself, by what each is expected to cost (longest first),
and turns xdist's reordering off (``tests/conftest.py``): the long files start at once, side by
side with the rest, and the many short ones fill the workers at the end.

The costs are estimates, not assertions (only their order matters): a file's measured seconds
where :data:`MEASURED` names it, else its number of tests times a typical test's cost for its
folder. A new long file is added to :data:`MEASURED`; a name there that no longer exists fails
``tests/unit/test_schedule.py``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

# Seconds a file takes in `make test` on the 2-core machine, where its tests are much longer than
# their folder's typical one (below): the chaos profile's and the single tests' from the CI run's
# --durations, the rest a loaded run's per-file sums scaled down to the CI's pace (about 1/2.8).
MEASURED: dict[str, float] = {
    "tests/chaos/test_chaos.py": 650,
    "tests/integration/test_failure_paths.py": 300,
    "tests/integration/test_handler_faults.py": 150,
    "tests/integration/test_dlq_scale.py": 120,
    "tests/integration/test_dlq_scan_end.py": 90,
    "tests/integration/test_no_table_migrate.py": 40,
    "tests/integration/test_outbox_cli.py": 35,
    "tests/security/test_no_password_leaks.py": 40,
    "tests/deploy/test_scale_out.py": 36,
    "tests/deploy/test_prometheus_scrape.py": 33,
}

# A typical test's seconds by folder (the longest matching prefix wins): the folders whose
# tests start a service, a server or a child process, and the rest (pure logic). Integration:
# about 11 s, the CI run's minutes less the other folders' over its 228 tests.
PER_TEST: dict[str, float] = {
    "tests/integration/": 10,
    "tests/security/": 5,
    "tests/deploy/": 3,
    "tests/install/": 30,
    "tests/chaos/": 3,
    "": 0.1,
}


def file_of(nodeid: str) -> str:
    """The file part of a test's node id (``--dist loadfile``'s unit of work)."""
    return nodeid.split("::", 1)[0]


def per_test(path: str) -> float:
    prefix = max((p for p in PER_TEST if path.startswith(p)), key=len)
    return PER_TEST[prefix]


def costs(nodeids: Iterable[str]) -> dict[str, float]:
    """Each file's expected seconds, for the tests ``nodeids`` select of it."""
    counts = Counter(file_of(nodeid) for nodeid in nodeids)
    return {path: MEASURED.get(path, count * per_test(path)) for path, count in counts.items()}


def longest_first(nodeids: list[str]) -> list[int]:
    """The indexes of ``nodeids`` in run order: the files by expected cost, longest first (ties
    in their collected order), each file's tests in their own order."""
    cost = costs(nodeids)
    first_seen: dict[str, int] = {}
    for index, nodeid in enumerate(nodeids):
        first_seen.setdefault(file_of(nodeid), index)
    return sorted(
        range(len(nodeids)),
        key=lambda i: (-cost[file_of(nodeids[i])], first_seen[file_of(nodeids[i])], i),
    )
