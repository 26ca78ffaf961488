"""The chaos suite's short profile inside the normal test run (``python -m tests.chaos`` runs it
alone, ``make chaos`` the long one): real consumer processes, each fault on its own and all
together, the handler faults together, a slow duplicate, a broker alarm, hostile producers and a
queue table of three queues (a crash loop, stalls and a dead-lettering storm in one), on
throwaway servers, 2,000 events per scenario (600 with the hostile producers); then, in the network
lab (namespaces), a silent broker cut past the heartbeat, a COMMIT's reply lost, latency and loss,
a clock skewed 10 minutes, and a node of a three-node cluster cut off from its peers; exactly-once
checked from the database and the queues."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.network import lab_namespaces
from tests.chaos.runner import run
from tests.chaos.scenarios import PROFILES


@pytest.mark.slow
@pytest.mark.timeout(1200)  # past the profile's own budget (1080s), which ends it cleanly
async def test_short_profile_applies_every_event_once_and_dead_letters_the_rest(
    tmp_path: Path,
) -> None:
    # Given the short profile's scenarios, each with its own consumers, names and database
    namespaces = lab_namespaces()
    # When events flow through every fault
    report = await run(PROFILES["short"], command="pytest tests/chaos", results_dir=tmp_path)

    # Then the network lab left no namespace behind (its processes and interfaces go with them:
    # tests/chaos/test_network.py)
    assert lab_namespaces() <= namespaces

    # and no event is lost or applied twice, and every invariant holds in every scenario
    print(report.markdown())
    problems = [
        f"{result.slug}: {problem}"
        for result in report.results
        for problem in (
            [result.skipped or result.error or ""]
            if result.verdict is None
            else result.verdict.violations + ([result.error] if result.error else [])
        )
        if problem
    ]
    assert report.ok, "\n".join(problems) + "\n\n" + report.table()
