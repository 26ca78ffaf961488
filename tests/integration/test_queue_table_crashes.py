"""Crash attribution with a queue table: a process's crash is attributed to one queue's
delivery, and never quarantines another queue's innocent deliveries.

The queues of one process share one isolation gate: a delivery that came back after a death is
applied with nothing of *any* queue in flight beside it, so the marks (which record the queue)
blame the culprit alone. The culprit's dead letter goes to its own queue's dead-letter queue,
the queue named. Crashes are simulated as the single-queue test does (a handler that ends its
process, exit 17), the service restarted each time as a supervisor would."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from consumer.db.crashes import CRASH_STRIKES
from tests.support import (
    ServiceProcess,
    TestEnv,
    behave,
    fetch,
    fetchval,
    queue_depth,
    restarted_while_it_dies,
    run_cli,
    wait_until,
)

# The killer's queue takes the handler that ends the process; the innocents' queue takes slow
# events, one at a time, so that many of them are in flight (delivered, unacknowledged) when the
# process dies, and each comes back redelivered beside the culprit.
TABLE = """
[queues.killer]
types = ["test.behave", "test.odd"]

[queues.innocent]
types = ["test.behave_many"]
prefetch = 20
workers = 1
batch_size = 1
db_pool_size = 2

[queues.rest]
types = ["inventory.restock", "inventory.reserve", "notification.requested"]
"""


def dlq(env: TestEnv, queue: str) -> list[dict[str, Any]]:
    result = run_cli("consumer", "dlq", "--queue", queue, "list", "--json", env=env.env())
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


async def test_a_crash_in_one_queue_never_quarantines_another_queue_s_deliveries(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a table of queues, its topology applied
    env.use_queue_table(TABLE, tmp_path)
    applied = run_cli("topology", "apply", env=env.env())
    assert applied.returncode == 0, applied.stderr
    killer_dead = f"{env.name}.killer.dead"
    innocent_dead = f"{env.name}.innocent.dead"

    # And innocent slow events in one queue, then, while they are in flight, an event whose
    # handler ends the process in another
    async with env.producer() as producer:
        innocents = [
            await producer.send("test.behave_many", {"key": f"i{n}", "sleep_s": 0.4})
            for n in range(12)
        ]
    service = ServiceProcess(env, "run-0").start()

    async def innocents_in_flight() -> bool:
        return int(await fetchval(env.database_url, "SELECT count(*) FROM handler_calls")) >= 1

    await wait_until(innocents_in_flight, timeout=30, what="the innocents' queue at work")
    async with env.producer() as producer:
        crasher = await producer.send("test.behave", behave("segfault", crash=True))

    # When a supervisor restarts the service each time it dies
    restarts, service = await restarted_while_it_dies(env, service, most=1 + CRASH_STRIKES)

    async def culprit_dead() -> bool:
        return await queue_depth(env.amqp_url, killer_dead) == 1

    await wait_until(culprit_dead, timeout=60, what="the culprit dead-lettered")

    # Then the deaths were the culprit's (the first in company, then CRASH_STRIKES alone)
    assert restarts == 1 + CRASH_STRIKES

    # And every innocent of the other queue is applied once, none dead-lettered
    async def innocents_applied() -> bool:
        count = await fetchval(
            env.database_url,
            "SELECT count(DISTINCT event_id) FROM test_effects WHERE event_id = ANY($1::uuid[])",
            innocents,
        )
        return int(count) == len(innocents)

    await wait_until(innocents_applied, timeout=60, what="every innocent applied")
    rows = await fetch(
        env.database_url, "SELECT event_id, count(*) AS n FROM test_effects GROUP BY event_id"
    )
    assert {row["event_id"]: row["n"] for row in rows} == dict.fromkeys(innocents, 1)
    assert await queue_depth(env.amqp_url, innocent_dead) == 0
    assert dlq(env, "innocent") == []
    # And the culprit's dead letter is in its own queue's dead-letter queue, the queue named
    [letter] = dlq(env, "killer")
    assert letter["id"] == str(crasher)
    assert letter["reason"] == "crashed"
    assert letter["error_class"] == "CrashedRepeatedly"
    assert "(queue killer)" in letter["error"]
    # And no mark is left behind
    assert await fetchval(env.database_url, "SELECT count(*) FROM consumer_in_progress") == 0
    assert await service.stop() == 0
    assert uuid.UUID(letter["id"]) == crasher
