"""This host's clock against the database's, skewed for real: the service runs under libfaketime
(Debian's ``faketime``, which ``make tools`` installs), the database on the true time.

10 minutes either way: start-up refuses with one line naming the skew (past
``CONSUMER_MAX_CLOCK_SKEW``); a skew within it starts, and the gauge shows it; a skew that grows
while the service runs is measured on the next prune round, a warning and the gauge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import ServiceProcess, TestEnv, faked, run_cli, wait_until


@pytest.mark.parametrize(("offset", "said"), [("+10m", "10m ahead of"), ("-10m", "10m behind")])
def test_a_service_10_minutes_off_the_databases_clock_refuses_to_start(
    env: TestEnv, tmp_path: Path, offset: str, said: str
) -> None:
    environment = faked(env.env(), tmp_path / "offset", offset)

    result = run_cli("consumer", "run", env=environment)

    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: this host's clock is {said} the database's"), lines[0]
    assert "more than CONSUMER_MAX_CLOCK_SKEW (1m)" in lines[0]
    logged = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line["event"] for line in logged if line.get("level") == "error"] == ["cannot run"]


async def test_a_skew_within_the_limit_starts_and_one_grown_since_is_reported(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a service 10s ahead of the database (the limit is 1m), pruning every second
    await env.apply_topology()
    offset = tmp_path / "offset"
    service = ServiceProcess(env, receipt_prune_interval="1s")
    service.environment = faked(service.environment, offset, "+10s")
    await service.start().wait_ready()

    # Then it runs, and says how far ahead it is
    ahead = await service.metric("consumer_clock_ahead_seconds")
    assert 5 < ahead < 15, ahead

    # And when its clock runs 10 minutes ahead meanwhile, the next round says so: a warning and
    # the gauge, not a stop
    offset.write_text("+10m")

    async def warned() -> bool:
        return any(
            line.get("event", "").startswith("clock skew past CONSUMER_MAX_CLOCK_SKEW")
            for line in service.log_lines()
        )

    await wait_until(warned, what="the clock skew warning")
    assert 590 < await service.metric("consumer_clock_ahead_seconds") < 610
    assert service.running
    assert await service.stop() == 0
