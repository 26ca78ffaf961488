"""The foundation's promise: every valid event's effect exactly once, under duplicates and kills."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime

import pytest

from consumer.service.components import memory_budget
from consumer.service.memory import worst_case
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    fetchval,
    queue_depth,
    wait_until,
)


@pytest.mark.parametrize("fast_path", ["true", "false"])
@pytest.mark.parametrize("batch_size", ["1", "25"])
async def test_a_thousand_reserves_with_duplicates_apply_exactly_once(
    env: TestEnv, batch_size: str, fast_path: str
) -> None:
    # Given a running service, on aiormq's fast paths or its own code, and a restocked SKU
    await env.apply_topology()
    service = ServiceProcess(
        env, batch_size=batch_size, prefetch="100", amqp_fast_path=fast_path
    ).start()
    await service.wait_ready()
    (starting,) = [line for line in service.log_lines() if line.get("event") == "starting"]
    assert starting["settings"]["amqp_fast_path"] is (fast_path == "true")
    # and the worst case its start-up memory check fitted, for the chaos suite to hold RSS to
    settings = env.settings(batch_size=batch_size, prefetch="100", amqp_fast_path=fast_path)
    assert starting["memory_budget_bytes"] == worst_case(memory_budget(settings))
    async with env.producer() as producer:
        restock = await producer.send("inventory.restock", {"sku": "SKU-1", "qty": 1500})
        await wait_until(
            lambda: _stock(env, "SKU-1", lambda available: available == 1500), what="the restock"
        )
        # When 1,000 reserves are published, with 10% of them published a second time
        events = [
            ("inventory.reserve", {"order_id": f"o-{n}", "sku": "SKU-1", "qty": 1}, uuid.uuid4())
            for n in range(1000)
        ]
        duplicates = random.Random(7).sample(events, 100)
        await producer.send_many([*events, *duplicates])

    # Then every reserve is applied once and the duplicates change nothing
    async def all_settled() -> bool:
        processed = await service.metric(
            "consumer_messages_total", type="inventory.reserve", outcome="processed"
        )
        duplicate = await service.metric(
            "consumer_messages_total", type="inventory.reserve", outcome="duplicate"
        )
        return processed + duplicate >= 1100

    await wait_until(all_settled, timeout=120, what="1,100 reserves to settle")
    assert (
        await fetchval(env.database_url, "SELECT available FROM stock WHERE sku = 'SKU-1'") == 500
    )
    reserves = [event_id for _, _, event_id in events]
    await assert_applied_once(env.database_url, [restock, *reserves], "stock_movements")
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 1001
    assert (
        await service.metric(
            "consumer_messages_total", type="inventory.reserve", outcome="processed"
        )
        == 1000
    )
    assert (
        await service.metric(
            "consumer_messages_total", type="inventory.reserve", outcome="duplicate"
        )
        == 100
    )
    assert await queue_depth(env.amqp_url, env.names.work) == 0
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


@pytest.mark.parametrize("batch_size", ["1", "25"])
async def test_sigkill_mid_stream_then_restart_applies_every_event_once(
    env: TestEnv, batch_size: str
) -> None:
    # Given 2,000 events waiting
    await env.apply_topology()
    ids = [uuid.uuid4() for _ in range(2000)]
    async with env.producer() as producer:
        await producer.send_many(
            ("test.behave", behave(f"k{n}", sleep_s=0.002), event_id)
            for n, event_id in enumerate(ids)
        )
    # When the consumer is killed with SIGKILL part-way through, then started again
    first = ServiceProcess(env, "first", batch_size=batch_size).start()
    await wait_until(
        lambda: _effects(env, lambda count: count >= 400), timeout=60, what="400 effects"
    )
    assert first.kill() == -9
    applied_at_kill = await fetchval(env.database_url, "SELECT count(*) FROM test_effects")
    assert applied_at_kill < 2000, "the kill should land mid-stream"
    second = await ServiceProcess(env, "second", batch_size=batch_size).start().wait_ready()

    # Then every event is applied exactly once and none is lost
    await wait_until(
        lambda: _effects(env, lambda count: count >= 2000), timeout=120, what="2,000 effects"
    )
    await second.wait_idle()
    await assert_applied_once(env.database_url, ids)
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 2000
    assert (
        await fetchval(
            env.database_url, "SELECT count(*) FROM (SELECT DISTINCT event_id FROM handler_calls) c"
        )
        == 2000
    )
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
    assert await queue_depth(env.amqp_url, env.names.work) == 0


async def test_malformed_body_and_unknown_type_are_dead_lettered_with_no_effect(
    env: TestEnv,
) -> None:
    await env.apply_topology()
    # Routed here under its own routing key only by a binding a removed handler left behind (under
    # another type's routing key it would be routing_key_mismatch).
    await env.bind_type("billing.charge")
    service = await ServiceProcess(env).start().wait_ready()
    async with env.producer() as producer:
        # Not JSON at all, and a valid envelope of a type no handler is registered for
        await producer.send_raw(b"{not json", "inventory.reserve")
        await producer.send_raw(
            b'{"event_id": "%s", "type": "billing.charge", "occurred_at": "%s", "payload": {}}'
            % (str(uuid.uuid4()).encode(), datetime.now(UTC).isoformat().encode()),
            "billing.charge",
        )

    async def both_dead() -> bool:
        return await queue_depth(env.amqp_url, env.names.dead) == 2

    await wait_until(both_dead, what="two dead letters")
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 0
    assert await fetchval(env.database_url, "SELECT count(*) FROM stock_movements") == 0
    assert await service.metric("consumer_messages_total", type="unknown", outcome="poison") == 2
    assert await service.metric("consumer_dead_letters_total", reason="not_json") == 1
    assert await service.metric("consumer_dead_letters_total", reason="unknown_type") == 1


async def _stock(env: TestEnv, sku: str, check: object) -> bool:
    available = await fetchval(env.database_url, "SELECT available FROM stock WHERE sku = $1", sku)
    return available is not None and bool(check(available))  # type: ignore[operator]


async def _effects(env: TestEnv, check: object) -> bool:
    count = await fetchval(env.database_url, "SELECT count(*) FROM test_effects")
    return bool(check(count))  # type: ignore[operator]
