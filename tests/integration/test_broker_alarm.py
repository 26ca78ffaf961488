"""A broker resource alarm blocks publishing connections; acks of committed events go on.

On a throwaway RabbitMQ node of the test's own: the alarm blocks every connection that publishes,
the test's producer included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import uuid
from typing import Any

import aiohttp

from tests.servers import ThrowawayRabbit
from tests.support import (
    Producer,
    ServiceProcess,
    TestEnv,
    behave,
    fetch,
    fetchval,
    queue_depth,
    wait_until,
)


def memory_alarm(rabbit: ThrowawayRabbit, *, on: bool) -> None:
    # A watermark of 0 sets the memory alarm off at once; 0.4 is the default.
    watermark = "0" if on else "0.4"
    subprocess.run(
        [*rabbit.ctl_command(), "set_vm_memory_high_watermark", watermark],
        check=True,
        capture_output=True,
        timeout=60,
    )


async def _metric(service: ServiceProcess, name: str, **labels: str) -> float:
    try:
        return await service.metric(name, **labels)
    except (aiohttp.ClientError, OSError):
        return -1


async def test_a_memory_alarm_blocks_retry_and_dead_letter_copies_not_acks(
    env: TestEnv, rabbit: ThrowawayRabbit
) -> None:
    # Given events waiting in the queue: most apply, some fail for good, some fail once
    env = dataclasses.replace(env, amqp_url=rabbit.url, topologies=[])
    settings = {"publish_timeout": "1s"}
    await env.apply_topology(**settings)
    good = [("test.behave", behave(f"g{n}"), uuid.uuid4()) for n in range(100)]
    permanent = [("test.behave", behave(f"p{n}", permanent=True), uuid.uuid4()) for n in range(10)]
    flaky = [("test.behave", behave(f"f{n}", fail_transient=1), uuid.uuid4()) for n in range(10)]
    events: list[tuple[str, dict[str, Any], uuid.UUID]] = [*good, *permanent, *flaky]
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many(events)

    # When the broker raises a memory alarm and the service starts under it
    memory_alarm(rabbit, on=True)
    try:
        service = await ServiceProcess(env, **settings).start().wait_ready()
        await wait_until(
            lambda: _effects(env, 100), timeout=30, what="the good events to be applied"
        )

        # Then the committed events are acked (only the failing ones are still held, waiting
        # for their copies' confirms), and no publish is given up while the broker blocks it
        async def only_failures_held() -> bool:
            return await _metric(service, "consumer_in_flight") == 20

        await wait_until(only_failures_held, timeout=20, what="the good events' acks")
        calls = await fetchval(env.database_url, "SELECT count(*) FROM handler_calls")
        await asyncio.sleep(3)  # three publish timeouts
        assert await _metric(service, "consumer_publish_failures_total") == 0
        assert await _metric(service, "consumer_in_flight") == 20
        # No loop of returns and redeliveries meanwhile: the failing events wait, unrun.
        assert await fetchval(env.database_url, "SELECT count(*) FROM handler_calls") == calls
        assert await _metric(service, "consumer_redeliveries_total") == 0
    finally:
        memory_alarm(rabbit, on=False)

    # And once the alarm clears, every copy lands once: the dead letters exactly once each,
    # the flaky events applied once after their retry
    await wait_until(lambda: _effects(env, 110), timeout=30, what="the flaky events")
    await wait_until(lambda: _depth(env, env.names.dead, 10), timeout=30, what="the dead letters")
    await asyncio.sleep(1)
    assert await queue_depth(env.amqp_url, env.names.dead) == 10
    rows = await fetch(
        env.database_url, "SELECT event_id, count(*) AS n FROM test_effects GROUP BY event_id"
    )
    assert {row["event_id"]: row["n"] for row in rows} == dict.fromkeys(
        [event_id for *_, event_id in [*good, *flaky]], 1
    )
    assert await _metric(service, "consumer_retries_published_total", rung="200ms") == 10
    assert await _metric(service, "consumer_publish_failures_total") == 0
    assert await _metric(service, "consumer_in_flight") == 0
    assert await _metric(service, "consumer_settled_twice_total") == 0
    assert await service.stop() == 0


async def _effects(env: TestEnv, expected: int) -> bool:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects")) >= expected


async def _depth(env: TestEnv, queue: str, expected: int) -> bool:
    return await queue_depth(env.amqp_url, queue) >= expected
