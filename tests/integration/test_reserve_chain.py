"""The reference handlers' chain on the real broker and database: an ``inventory.reserve`` that
names whom to tell (``notify``) publishes a ``notification.requested`` through the outbox, the
service's relay sends it, and the notification handler records it; a reservation that fails, or
one without ``notify`` (the benchmarks' and the chaos suite's), publishes nothing."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg

from consumer import PermanentError
from consumer.handlers.inventory import RESERVED_TEMPLATE, reserve
from consumer.outbox import follow_up_id
from consumer.registry import HandlerRegistry
from tests.support import (
    REFERENCE_HANDLERS,
    Event,
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    fetch,
    fetchval,
    queue_depth,
    reservation_in_a_call,
    run_cli,
    wait_until,
)

NOTIFY = "ops@example.com"


def publish(env: TestEnv, event_type: str, payload: dict[str, Any]) -> uuid.UUID:
    """``consumer publish``, as a user types it: the event id it prints."""
    result = run_cli(
        "consumer",
        *("publish", "--type", event_type, "--payload", json.dumps(payload)),
        env=env.env(),
    )
    assert result.returncode == 0, result.stderr
    return uuid.UUID(result.stdout.strip())


async def _receipted(env: TestEnv, event_id: uuid.UUID) -> bool:
    found = await fetchval(
        env.database_url, "SELECT count(*) FROM receipts WHERE event_id = $1", event_id
    )
    return int(found) == 1


async def _notifications(env: TestEnv) -> list[asyncpg.Record]:
    return await fetch(
        env.database_url,
        "SELECT event_id, recipient, template, params FROM notifications ORDER BY id",
    )


async def _outbox(env: TestEnv) -> list[asyncpg.Record]:
    return await fetch(
        env.database_url,
        "SELECT event_id, type, order_key, caused_by, caused_by_consumer, sent_at FROM outbox "
        "ORDER BY id",
    )


def _caused(env: TestEnv, cause: uuid.UUID) -> uuid.UUID:
    """The id of the one event ``cause``'s handler published."""
    return follow_up_id(cause, env.name, 0)


async def test_a_published_reservation_with_notify_ends_in_a_notification(env: TestEnv) -> None:
    # Given the service with its relay on (the reference handlers), and a SKU in stock
    await env.apply_topology()
    service = await ServiceProcess(env, outbox_relay="on").start().wait_ready()
    restocked = publish(env, "inventory.restock", {"sku": "A-1", "qty": 5})
    await wait_until(lambda: _receipted(env, restocked), what="the restock applied")

    # When one reservation that names whom to tell is published, as the README's demo does
    order = {"order_id": "o-1", "sku": "A-1", "qty": 2, "notify": NOTIFY}
    cause = publish(env, "inventory.reserve", order)
    caused = _caused(env, cause)
    await wait_until(lambda: _receipted(env, caused), what="the notification applied")
    await service.wait_idle()

    # Then the stock is reserved
    assert await fetchval(env.database_url, "SELECT available FROM stock WHERE sku = 'A-1'") == 3
    # And one outbox row, caused by the reservation, keyed by its order, sent
    [row] = await _outbox(env)
    assert row["event_id"] == caused
    assert (row["type"], row["order_key"]) == ("notification.requested", "o-1")
    assert (row["caused_by"], row["caused_by_consumer"]) == (cause, env.name)
    assert row["sent_at"] is not None
    # And the notification row is the caused event's, for the recipient, with the order's params
    [notification] = await _notifications(env)
    assert notification["event_id"] == caused
    assert (notification["recipient"], notification["template"]) == (NOTIFY, RESERVED_TEMPLATE)
    assert json.loads(notification["params"]) == {"order_id": "o-1", "sku": "A-1", "qty": 2}
    # And each of the two events has its receipt, and its effect once
    await assert_applied_once(env.database_url, [restocked, cause], "stock_movements")
    await assert_applied_once(env.database_url, [caused], "notifications")
    # And `consumer events show` follows the reservation to the notification it caused
    shown = run_cli("consumer", "events", "show", str(cause), env=env.env())
    assert shown.returncode == 0, shown.stderr
    [line] = [line for line in shown.stdout.splitlines() if line.startswith("caused:")]
    assert line.split()[1:3] == [str(caused), "notification.requested,"]
    assert ", sent " in line


async def test_a_reservation_without_notify_publishes_nothing(env: TestEnv) -> None:
    # Given the service with its relay on, and a SKU in stock
    await env.apply_topology()
    service = await ServiceProcess(env, outbox_relay="on").start().wait_ready()
    restocked = publish(env, "inventory.restock", {"sku": "A-1", "qty": 5})
    await wait_until(lambda: _receipted(env, restocked), what="the restock applied")

    # When a reservation without notify is published (the benchmarks' and chaos suite's kind)
    cause = publish(env, "inventory.reserve", {"order_id": "o-1", "sku": "A-1", "qty": 2})
    await wait_until(lambda: _receipted(env, cause), what="the reservation applied")
    await service.wait_idle()

    # Then the stock is reserved, and no outbox row nor notification follows
    assert await fetchval(env.database_url, "SELECT available FROM stock WHERE sku = 'A-1'") == 3
    assert await _outbox(env) == []
    assert await _notifications(env) == []


async def test_a_backlog_of_reservations_notifies_for_those_made_only(env: TestEnv) -> None:
    # Given, in one backlog: a restock of 5, then reservations of 2, 2, 3 (too many by then), 1
    # and 1 for a SKU that does not exist, each naming whom to tell
    await env.apply_topology()
    restock: Event = ("inventory.restock", {"sku": "A", "qty": 5}, uuid.uuid4())
    reserves: list[Event] = [
        (
            "inventory.reserve",
            {"order_id": f"o-{n}", "sku": sku, "qty": qty, "notify": f"c{n}"},
            uuid.uuid4(),
        )
        for n, (sku, qty) in enumerate([("A", 2), ("A", 2), ("A", 3), ("A", 1), ("nope", 1)])
    ]
    async with env.producer() as producer:
        for event in [restock, *reserves]:  # one at a time: the queue's order is the batch's
            await producer.send(event[0], event[1], event_id=event[2])

    # When one worker applies them, in batches, the relay on
    service = ServiceProcess(env, batch_size="50", db_pool_size="1", outbox_relay="on")
    await service.start().wait_ready()
    made = [reserves[n][2] for n in (0, 1, 3)]
    failed = [reserves[n][2] for n in (2, 4)]

    async def all_settled() -> bool:
        dead = await queue_depth(env.amqp_url, env.names.dead)
        notified = await fetchval(env.database_url, "SELECT count(*) FROM notifications")
        return dead == 2 and int(notified) == len(made)

    await wait_until(all_settled, what="2 dead letters and 3 notifications")
    await service.wait_idle()

    # Then the reservations made each caused one notification, sent and applied once
    caused = [_caused(env, cause) for cause in made]
    rows = await _outbox(env)
    pairs = sorted((row["caused_by"], row["event_id"]) for row in rows)
    assert pairs == sorted(zip(made, caused, strict=True))
    assert all(row["sent_at"] is not None for row in rows)
    await assert_applied_once(env.database_url, caused, "notifications")
    recipients = {row["event_id"]: row["recipient"] for row in await _notifications(env)}
    assert recipients == {caused[0]: "c0", caused[1]: "c1", caused[2]: "c3"}
    # And the ones that failed took no stock and caused nothing
    assert await fetchval(env.database_url, "SELECT available FROM stock WHERE sku = 'A'") == 0
    movements = await fetch(env.database_url, "SELECT event_id FROM stock_movements")
    assert not {row["event_id"] for row in movements} & set(failed)
    assert not {row["caused_by"] for row in rows} & set(failed)


async def test_the_batch_path_publishes_for_the_reservations_it_makes(env: TestEnv) -> None:
    # Given a SKU with 5 in stock, and the batch function called as the service calls it with
    # a run of several events (not the one-event path)
    registry = HandlerRegistry.from_modules(REFERENCE_HANDLERS.split(","))
    orders = [
        ("A", 2, NOTIFY),
        ("A", 4, NOTIFY),
        ("A", 2, None),
        ("B", 1, NOTIFY),
        ("A", 1, NOTIFY),
    ]
    calls = [
        reservation_in_a_call(
            {"order_id": f"o-{n}", "sku": sku, "qty": qty, "notify": notify}, registry
        )
        for n, (sku, qty, notify) in enumerate(orders)
    ]
    events = [event for event, _ in calls]
    conn = await asyncpg.connect(env.database_url)
    try:
        await conn.execute("INSERT INTO stock (sku, available) VALUES ('A', 5)")

        # When it decides them in one transaction
        async with conn.transaction():
            results = await reserve(events, conn)
        available = await conn.fetchval("SELECT available FROM stock WHERE sku = 'A'")
    finally:
        await conn.close()

    # Then the 2, the 2 without notify and the 1 are made; the 4 (too many) and the unknown
    # SKU fail
    assert [type(result) if result else None for result in results] == [
        None,
        PermanentError,
        None,
        PermanentError,
        None,
    ]
    assert available == 0
    # And only the reservations made with notify published, one notification each
    published = [publishes.rows for _, publishes in calls]
    assert [len(rows) for rows in published] == [1, 0, 0, 0, 1]
    for n in (0, 4):
        [row] = published[n]
        body = json.loads(row.body)
        assert (row.type, row.order_key, row.caused_by) == (
            "notification.requested",
            f"o-{n}",
            events[n].event_id,
        )
        assert body["payload"]["params"] == {"order_id": f"o-{n}", "sku": "A", "qty": orders[n][1]}
