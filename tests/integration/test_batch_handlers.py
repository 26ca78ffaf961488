"""Batch handlers (``register_batch``): one call per run of a batch, each event judged alone."""

from __future__ import annotations

import random
import uuid
from typing import Any

from consumer.amqp import headers as h
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    drain_queue,
    fetch,
    fetchval,
    queue_depth,
    wait_until,
)

Event = tuple[str, dict[str, Any], uuid.UUID]


def _many(key: str, **spec: Any) -> Event:
    return ("test.behave_many", {"key": key, **spec}, uuid.uuid4())


async def _effects(env: TestEnv) -> int:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects"))


async def test_a_backlog_goes_through_few_calls_and_each_failure_stays_alone(
    env: TestEnv,
) -> None:
    # Given a backlog of batch-handled events: 10% failing for good, 10% failing once, duplicates
    await env.apply_topology()
    rng = random.Random(5)
    events: list[Event] = []
    kinds: dict[uuid.UUID, str] = {}
    for n in range(600):
        roll = rng.random()
        spec: dict[str, Any] = {"permanent": True} if roll < 0.1 else {}
        if 0.1 <= roll < 0.2:
            spec = {"fail_transient": 1}
        event = _many(f"k{n}", **spec)
        kinds[event[2]] = "dead" if roll < 0.1 else "applied"
        events.append(event)
    duplicates = rng.sample([event for event in events if kinds[event[2]] == "applied"], 60)
    async with env.producer() as producer:
        await producer.send_many([*events, *duplicates])

    # When the service starts on it
    service = await ServiceProcess(env, batch_size="50", prefetch="200").start().wait_ready()
    applied = sum(1 for kind in kinds.values() if kind == "applied")
    dead = len(events) - applied

    async def done() -> bool:
        letters = await queue_depth(env.amqp_url, env.names.dead)
        return await _effects(env) == applied and letters >= dead

    await wait_until(done, timeout=120, what="the backlog")
    await service.wait_idle()

    # Then every good event is applied once, by far fewer calls than events
    good = [event_id for event_id, kind in kinds.items() if kind == "applied"]
    await assert_applied_once(env.database_url, good)
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == applied
    calls = await fetch(env.database_url, "SELECT size FROM batch_calls")
    assert max(row["size"] for row in calls) > 10
    # And each failure is only its own: no receipt, a dead letter or a retry of its own
    dead_ids = [event_id for event_id, kind in kinds.items() if kind == "dead"]
    leaked = await fetchval(
        env.database_url,
        "SELECT count(*) FROM receipts WHERE event_id = ANY($1::uuid[])",
        dead_ids,
    )
    assert leaked == 0
    letters = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    assert len(letters) == dead
    assert {message.headers[h.ERROR_CLASS] for message in letters} == {"PermanentError"}
    assert {message.headers[h.REASON] for message in letters} == {"permanent_failure"}
    # (an event failing once may not need its retry: a batch that fails runs again event by event)
    transient = sum(1 for event in events if event[1].get("fail_transient"))
    assert 0 < await service.metric("consumer_retries_published_total", rung="200ms") <= transient
    assert await service.metric(
        "consumer_messages_total", type="test.behave_many", outcome="duplicate"
    ) == len(duplicates)


async def test_a_call_that_raises_is_retried_event_by_event_at_no_cost(env: TestEnv) -> None:
    # Given a backlog in which one event spoils any batch call it shares
    await env.apply_topology()
    events = [_many(f"k{n}") for n in range(40)]
    events.insert(20, _many("spoiler", spoil_batch=True))
    async with env.producer() as producer:
        await producer.send_many(events)

    # When the service applies it in batches
    service = await ServiceProcess(env, batch_size="50", db_pool_size="1").start().wait_ready()
    await wait_until(lambda: _effects_are(env, len(events)), timeout=60, what="every event applied")
    await service.wait_idle()
    await assert_applied_once(env.database_url, [event_id for _, _, event_id in events])

    # Then the spoiled call blamed no event: each went again alone and was applied, no retry spent
    sizes = [row["size"] for row in await fetch(env.database_url, "SELECT size FROM batch_calls")]
    assert max(sizes) > 1
    assert sizes.count(1) >= 2
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
    assert await service.metric("consumer_retries_published_total", rung="200ms") == 0


async def test_a_call_past_its_time_limit_is_retried_event_by_event(env: TestEnv) -> None:
    # Given ten quick events and one that makes any call it is in sleep past the 2s limit
    await env.apply_topology()
    events = [_many(f"k{n}") for n in range(10)]
    events.append(_many("slow", sleep_s=3))
    async with env.producer() as producer:
        await producer.send_many(events)

    # When the service applies them
    await ServiceProcess(env, batch_size="50", db_pool_size="1").start().wait_ready()

    # Then the ten quick ones are applied after the timed-out call, each alone, and the slow one
    # (which times out alone too) climbs the retry ladder and is dead-lettered in the end
    await wait_until(lambda: _effects_are(env, 10), timeout=60, what="the quick events")
    await wait_until(
        lambda: _depth_is(env, env.names.dead, 1), timeout=60, what="the slow event dead"
    )
    [letter] = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    assert letter.headers[h.ERROR_CLASS] == "HandlerTimeout"
    assert letter.headers[h.REASON] == "retries_exhausted"
    await assert_applied_once(env.database_url, [event_id for _, _, event_id in events[:10]])


async def test_a_batch_handler_that_miscounts_is_a_permanent_failure_with_its_reason(
    env: TestEnv,
) -> None:
    # Given an event that makes its batch handler return too few results
    await env.apply_topology()
    await ServiceProcess(env).start().wait_ready()
    async with env.producer() as producer:
        await producer.send("test.behave_many", {"key": "miscounted", "miscount": True})

    # Then it is dead-lettered once, with no effect, naming the handler's mistake
    await wait_until(lambda: _depth_is(env, env.names.dead, 1), timeout=30, what="a dead letter")
    [letter] = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    assert letter.headers[h.ERROR_CLASS] == "BatchResultError"
    assert "returned 0 results for 1 events" in str(letter.headers[h.ERROR_MESSAGE])
    assert await _effects(env) == 0
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 0


async def test_reserves_in_one_batch_are_decided_in_order_as_one_at_a_time(env: TestEnv) -> None:
    # Given, in one backlog: a restock of 5, reserves of 4, 3 (too many by then), 1, and one for
    # a SKU that does not exist
    await env.apply_topology()
    sends: list[Event] = [
        ("inventory.restock", {"sku": "A", "qty": 5}, uuid.uuid4()),
        ("inventory.reserve", {"order_id": "o-1", "sku": "A", "qty": 4}, uuid.uuid4()),
        ("inventory.reserve", {"order_id": "o-2", "sku": "A", "qty": 3}, uuid.uuid4()),
        ("inventory.reserve", {"order_id": "o-3", "sku": "A", "qty": 1}, uuid.uuid4()),
        ("inventory.reserve", {"order_id": "o-4", "sku": "nope", "qty": 1}, uuid.uuid4()),
    ]
    async with env.producer() as producer:
        for event in sends:  # one at a time: the order of the queue is the order of the batch
            await producer.send(event[0], event[1], event_id=event[2])

    # When one worker applies them
    await ServiceProcess(env, batch_size="50", db_pool_size="1").start().wait_ready()
    await wait_until(lambda: _depth_is(env, env.names.dead, 2), timeout=30, what="2 dead letters")

    # Then the restock came first, the 3 did not fit and took nothing, the 1 still fitted
    assert await fetchval(env.database_url, "SELECT available FROM stock WHERE sku = 'A'") == 0
    movements = await fetch(
        env.database_url, "SELECT order_id, delta FROM stock_movements ORDER BY id"
    )
    assert [(row["order_id"], row["delta"]) for row in movements] == [
        (None, 5),
        ("o-1", -4),
        ("o-3", -1),
    ]
    letters = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    messages = sorted(str(letter.headers[h.ERROR_MESSAGE]) for letter in letters)
    assert messages == [
        "insufficient stock for 'A': 1 available, 3 asked",
        "unknown SKU 'nope'",
    ]
    applied = [sends[0][2], sends[1][2], sends[3][2]]  # the restock, the 4 and the 1
    await assert_applied_once(env.database_url, applied, "stock_movements")
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 3


async def _effects_are(env: TestEnv, count: int) -> bool:
    return await _effects(env) == count


async def _depth_is(env: TestEnv, queue: str, count: int) -> bool:
    return await queue_depth(env.amqp_url, queue) == count
