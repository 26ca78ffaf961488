"""Scaling out is competing consumers on one quorum work queue: three replicas share it, and
losing one gracefully (SIGTERM) and one abruptly (SIGKILL) while events flow still applies every
event exactly once."""

from __future__ import annotations

import signal
import uuid
from typing import Any

from tests.servers import free_port
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    fetch,
    fetchval,
    queue_depth,
    wait_until,
)

BATCH = 200


def _batch(label: str) -> list[tuple[str, dict[str, Any], uuid.UUID]]:
    # A little handler time keeps deliveries in flight when replicas are stopped and killed.
    return [
        ("test.behave", behave(f"{label}-{n}", sleep_s=0.1), uuid.uuid4()) for n in range(BATCH)
    ]


async def _applied(env: TestEnv) -> int:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects"))


async def test_three_replicas_apply_every_event_once_while_one_stops_and_one_dies(
    env: TestEnv,
) -> None:
    # Given three replicas of the service on one work queue, each with its own HTTP port and
    # four workers (the handler waits 0.1 s an event: one worker, the default at this prefetch,
    # would leave the survivor ten events a second)
    await env.apply_topology()
    replicas = [
        ServiceProcess(env, f"replica-{n}", http_port=str(free_port()), workers="4").start()
        for n in range(3)
    ]
    for replica in replicas:
        await replica.wait_ready()
    stopped, killed, survivor = replicas
    batches = [_batch("first"), _batch("second"), _batch("third")]
    sent = {event_id for batch in batches for _, _, event_id in batch}

    async with env.producer() as producer:
        # When the first batch flows, and all three replicas take part in it
        await producer.send_many(batches[0])

        async def all_three_working() -> bool:
            pids = await fetch(env.database_url, "SELECT DISTINCT pid FROM handler_calls")
            return {row["pid"] for row in pids} >= {replica.pid for replica in replicas}

        await wait_until(all_three_working, what="every replica to handle events")

        # And one replica is told to stop while the second batch is sent
        stopped.signal(signal.SIGTERM)
        await producer.send_many(batches[1])

        # And another is killed while it holds deliveries
        async def holding() -> bool:
            return await killed.metric("consumer_in_flight") > 0

        await wait_until(holding, what="the replica to be killed to hold deliveries")
        assert killed.kill() == -signal.SIGKILL
        await producer.send_many(batches[2])

    # Then every event is applied exactly once, by whichever replica got it
    async def all_applied() -> bool:
        return await _applied(env) == len(sent)

    await wait_until(all_applied, timeout=60, what=f"{len(sent)} effects")
    await survivor.wait_idle()
    await assert_applied_once(env.database_url, sent)
    receipts = await fetch(
        env.database_url, "SELECT event_id FROM receipts WHERE consumer = $1", env.name
    )
    assert len(receipts) == len(sent)
    assert {row["event_id"] for row in receipts} == sent

    # And the stopped replica drained and exited cleanly, the killed one's deliveries came back
    assert await stopped.wait_exit() == 0
    assert await survivor.metric("consumer_redeliveries_total") > 0
    assert await queue_depth(env.amqp_url, env.names.work) == 0
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
