"""Surviving the broker and the database going away, on throwaway servers of the test's own."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tests.conftest import make_template
from tests.servers import ThrowawayPostgres, ThrowawayRabbit
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_exactly_once,
    movements_at_least,
    queue_depth,
    restocks,
    wait_until,
)


@pytest.fixture
def broker_env(rabbit: ThrowawayRabbit, env: TestEnv) -> TestEnv:
    # The node first: it outlives env's teardown, which checks the service still running on it.
    return dataclasses.replace(env, amqp_url=rabbit.url, topologies=[])


async def test_connection_closes_and_a_broker_restart_lose_and_double_nothing(
    broker_env: TestEnv, rabbit: ThrowawayRabbit
) -> None:
    env = broker_env
    await env.apply_topology()
    events = restocks(3000)
    async with env.producer() as producer:
        await producer.send_many(events)
    service = await ServiceProcess(env).start().wait_ready()

    await wait_until(
        lambda: movements_at_least(env.database_url, 300), timeout=60, what="300 applied"
    )
    rabbit.close_all_connections()  # the broker drops us mid-stream

    await wait_until(
        lambda: movements_at_least(env.database_url, 1500), timeout=60, what="1,500 applied"
    )
    rabbit.stop()

    async def disconnected() -> bool:
        status, body = await service.readyz()
        return status == 503 and body["broker_connected"] is False

    await wait_until(disconnected, timeout=15, what="readyz false while the broker is down")
    assert await service.metric("consumer_broker_connected") == 0
    rabbit.start()

    await wait_until(
        lambda: movements_at_least(env.database_url, 3000), timeout=120, what="all 3,000 applied"
    )
    await service.wait_ready(timeout=30)
    await service.wait_idle()
    await assert_exactly_once(env.database_url, events)
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
    assert await queue_depth(env.amqp_url, env.names.work) == 0
    assert await service.metric("consumer_broker_connected") == 1


async def test_a_database_outage_longer_than_the_ladder_pauses_and_dead_letters_nothing(
    postgres: ThrowawayPostgres, env: TestEnv
) -> None:
    await make_template(postgres.admin_dsn, "consumer")
    dsn = postgres.dsn("consumer")
    env = dataclasses.replace(env, database_url=dsn)
    await env.apply_topology(delivery_limit="3")
    service = await ServiceProcess(env, delivery_limit="3").start().wait_ready()
    events = restocks(600)

    async def publish_steadily() -> None:
        async with env.producer() as producer:
            for start in range(0, len(events), 20):
                await producer.send_many(events[start : start + 20])
                await asyncio.sleep(0.1)  # about 200 events a second, for three seconds

    publishing = asyncio.create_task(publish_steadily())
    await wait_until(
        lambda: movements_at_least(env.database_url, 100), timeout=30, what="100 applied"
    )
    postgres.stop()

    async def paused() -> bool:
        status, body = await service.readyz()
        return status == 503 and body["paused"] is True and body["database"] is False

    await wait_until(paused, timeout=15, what="the service to pause")
    assert await service.metric("consumer_paused") == 1
    # The consumer stays registered through a pause: what it holds counts against its prefetch.
    assert await service.metric("consumer_consuming") == 1
    # Down for longer than the whole retry ladder (200ms + 400ms + 800ms) while events arrive.
    await asyncio.sleep(4)
    await publishing
    postgres.start()

    await wait_until(
        lambda: movements_at_least(env.database_url, 600), timeout=90, what="all 600 applied"
    )
    await service.wait_ready(timeout=30)
    await service.wait_idle()
    await assert_exactly_once(dsn, events)
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
    assert await service.metric("consumer_paused") == 0
    assert await service.metric("consumer_retries_published_total", rung="200ms") == 0
    for reason in ("permanent_failure", "retries_exhausted"):
        assert await service.metric("consumer_dead_letters_total", reason=reason) == 0
    paused_lines = [x for x in service.log_lines() if x.get("event") == "paused"]
    assert paused_lines, "the pause is logged"


async def test_a_frozen_database_pauses_instead_of_spending_retries(
    postgres: ThrowawayPostgres, env: TestEnv
) -> None:
    await make_template(postgres.admin_dsn, "consumer")
    dsn = postgres.dsn("consumer")
    env = dataclasses.replace(env, database_url=dsn)
    settings = {"handler_timeout": "1s", "hard_timeout": "5s", "delivery_limit": "3"}
    await env.apply_topology(**settings)
    service = await ServiceProcess(env, **settings).start().wait_ready()
    events = restocks(400)
    async with env.producer() as producer:
        await producer.send_many(events[:100])
        await wait_until(
            lambda: movements_at_least(env.database_url, 100), timeout=30, what="100 applied"
        )
        # Frozen, not down: connections hang instead of failing, past the handler's time limit.
        postgres.freeze()
        await producer.send_many(events[100:])

        async def paused() -> bool:
            return await service.metric("consumer_paused") == 1

        await wait_until(paused, timeout=30, what="the service to pause")
        await asyncio.sleep(3)  # longer than the whole retry ladder
        postgres.thaw()

    await wait_until(
        lambda: movements_at_least(env.database_url, 400), timeout=120, what="all 400 applied"
    )
    await service.wait_idle()
    await assert_exactly_once(dsn, events)
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
    for reason in ("permanent_failure", "retries_exhausted"):
        assert await service.metric("consumer_dead_letters_total", reason=reason) == 0
