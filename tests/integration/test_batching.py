"""Many events per transaction: a failure rolls back only itself; contention costs nothing."""

from __future__ import annotations

import random
import uuid
from typing import Any

from tests.servers import free_port
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    fetchval,
    queue_depth,
    wait_until,
)


async def test_a_mixed_stream_in_batches_keeps_every_promise(env: TestEnv) -> None:
    # Given a service applying up to 25 events per transaction
    await env.apply_topology()
    service = await ServiceProcess(env, batch_size="25", prefetch="200").start().wait_ready()
    rng = random.Random(11)
    events: list[tuple[str, dict[str, Any], uuid.UUID]] = []
    kinds: dict[uuid.UUID, str] = {}
    for n in range(1200):
        roll = rng.random()
        if roll < 0.05:
            spec, kind = behave(f"p{n}", permanent=True), "dead"
        elif roll < 0.10:
            spec, kind = behave(f"t{n}", fail_transient=1), "applied"
        elif roll < 0.55:
            # Five hot SKUs, touched in every order by concurrent batches: lock conflicts.
            events.append(
                ("inventory.restock", {"sku": f"S{rng.randrange(5)}", "qty": 1}, uuid.uuid4())
            )
            continue
        else:
            spec, kind = behave(f"k{n}"), "applied"
        event_id = uuid.uuid4()
        kinds[event_id] = kind
        events.append(("test.behave", spec, event_id))
    duplicates = rng.sample(events, 120)

    # When the stream arrives with duplicates and a few poison messages
    async with env.producer() as producer:
        await producer.send_many([*events, *duplicates])
        for _ in range(10):
            await producer.send_raw(b"\x00not json", "test.behave")

    restocks = sum(1 for event in events if event[0] == "inventory.restock")
    applied = sum(1 for kind in kinds.values() if kind == "applied")
    dead = sum(1 for kind in kinds.values() if kind == "dead")

    async def done() -> bool:
        movements = await fetchval(env.database_url, "SELECT count(*) FROM stock_movements")
        effects = await fetchval(env.database_url, "SELECT count(*) FROM test_effects")
        letters = await queue_depth(env.amqp_url, env.names.dead)
        return bool(movements == restocks and effects == applied and letters >= dead + 10)

    await wait_until(done, timeout=120, what="the whole stream")
    await service.wait_idle()

    # Then each valid event is applied once, each bad one dead-lettered, nothing else
    restock_ids = [event_id for kind, _, event_id in events if kind == "inventory.restock"]
    await assert_applied_once(env.database_url, restock_ids, "stock_movements")
    await assert_applied_once(env.database_url, [k for k, v in kinds.items() if v == "applied"])
    assert await fetchval(env.database_url, "SELECT sum(available) FROM stock") == restocks
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == restocks + applied
    dead_ids = {k for k, v in kinds.items() if v == "dead"}
    leaked = await fetchval(
        env.database_url,
        "SELECT count(*) FROM receipts WHERE event_id = ANY($1::uuid[])",
        list(dead_ids),
    )
    assert leaked == 0
    # A permanent failure duplicated in the stream is dead-lettered once per copy.
    duplicated_dead = sum(1 for event in duplicates if event[2] in dead_ids)
    assert await queue_depth(env.amqp_url, env.names.dead) == dead + duplicated_dead + 10
    assert await service.metric("consumer_dead_letters_total", reason="retries_exhausted") == 0


async def test_batches_of_two_processes_fighting_over_rows_go_round_again_and_lose_nothing(
    env: TestEnv,
) -> None:
    # Given two service processes on one work queue, batching up to 25 events, waiting at most
    # 1ms for another transaction's row lock: key routing keeps a SKU on one worker of a process,
    # not across processes, so their batches of the same three SKUs collide
    await env.apply_topology()
    skus = ["A", "B", "C"]
    settings = {"batch_size": "25", "batch_lock_timeout": "1ms", "prefetch": "200"}
    services = [
        ServiceProcess(env, f"process-{n}", http_port=str(free_port()), **settings).start()
        for n in range(2)
    ]
    for service in services:
        await service.wait_ready()
    opening = [("inventory.restock", {"sku": sku, "qty": 10_000}, uuid.uuid4()) for sku in skus]
    async with env.producer() as producer:
        await producer.send_many(opening)
    await wait_until(lambda: _movements_are(env, len(skus)), what="the opening stock")

    # When restocks and reserves of those SKUs arrive in a stream
    rng = random.Random(3)
    events: list[tuple[str, dict[str, Any], uuid.UUID]] = []
    for n in range(3000):
        sku, qty = rng.choice(skus), rng.randint(1, 3)
        if rng.random() < 0.5:
            events.append(("inventory.restock", {"sku": sku, "qty": qty}, uuid.uuid4()))
        else:
            order = {"order_id": f"o-{n}", "sku": sku, "qty": qty}
            events.append(("inventory.reserve", order, uuid.uuid4()))
    async with env.producer() as producer:
        await producer.send_many(events)
    await wait_until(
        lambda: _movements_are(env, len(opening) + len(events)), timeout=180, what="every event"
    )
    for service in services:
        await service.wait_idle()

    # Then batches went round again on lock conflicts, and every event was applied exactly once:
    # one movement each, and the stock adds up exactly
    conflicts = [await service.metric("consumer_batch_conflicts_total") for service in services]
    assert sum(conflicts) > 0, conflicts
    await assert_applied_once(
        env.database_url, [event_id for _, _, event_id in [*opening, *events]], "stock_movements"
    )
    for sku in skus:
        change = sum(
            payload["qty"] if kind == "inventory.restock" else -payload["qty"]
            for kind, payload, _ in events
            if payload["sku"] == sku
        )
        available = await fetchval(
            env.database_url, "SELECT available FROM stock WHERE sku = $1", sku
        )
        moved = await fetchval(
            env.database_url, "SELECT sum(delta) FROM stock_movements WHERE sku = $1", sku
        )
        assert available == moved == 10_000 + change
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == len(opening) + len(
        events
    )
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


async def _movements_are(env: TestEnv, expected: int) -> bool:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM stock_movements")) == expected
