"""The outbox relay against the real broker and database: committed rows published to the ingress
exchange and marked sent, woken by the commit's notification, two relays on one table keeping
each key's order, rolled-back rows never published, a terminated LISTEN connection made again,
and a service that relays while it consumes.

Rows are written with plain SQL, as the outbox's writers do (sql/008): the envelope exactly as
``consumer publish`` builds it, its headers, its key."""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from functools import partial
from typing import Any

import aio_pika
import asyncpg
from prometheus_client import CollectorRegistry

from consumer.amqp.publisher import Publisher
from consumer.envelope import envelope_body
from consumer.logs import make_logger
from consumer.observe.metrics import Metrics
from consumer.outbox import follow_up_id
from consumer.service.outbox_relay import OutboxRelay, RelayConfig
from tests.support import (
    TEST_HANDLERS,
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    drain_queue,
    fetch,
    fetchval,
    movements,
    restocks,
    wait_until,
)
from topology.names import SHARD_KEY

RESTOCK = "inventory.restock"
# A poll far longer than any wait below: whatever is published in time was woken by a commit.
NEVER_POLLS = 600.0


async def enqueue(
    conn: asyncpg.Connection[Any],
    payload: dict[str, Any],
    *,
    key: str | None = None,
    event_type: str = RESTOCK,
    headers: dict[str, Any] | None = None,
) -> uuid.UUID:
    """One outbox row in ``conn``'s transaction (or alone): the event's id."""
    event_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO outbox (event_id, type, order_key, body, headers)"
        " VALUES ($1, $2, $3, $4, $5::jsonb)",
        event_id,
        event_type,
        key,
        envelope_body(event_type, payload, event_id=event_id),
        json.dumps(headers or {}),
    )
    return event_id


async def unsent(env: TestEnv) -> int:
    return int(
        await fetchval(env.database_url, "SELECT count(*) FROM outbox WHERE sent_at IS NULL")
    )


async def all_sent(env: TestEnv) -> bool:
    return await unsent(env) == 0


async def sent(env: TestEnv, event_id: uuid.UUID) -> bool:
    return bool(
        await fetchval(
            env.database_url, "SELECT sent_at IS NOT NULL FROM outbox WHERE event_id = $1", event_id
        )
    )


async def failed_once(conn: asyncpg.Connection[Any], event_id: uuid.UUID) -> str:
    """Asserts that the row was refused for good at its first attempt, never sent: its error."""
    (row,) = await conn.fetch(
        "SELECT sent_at, failed_at, attempts, last_error FROM outbox WHERE event_id = $1",
        event_id,
    )
    assert row["sent_at"] is None
    assert row["failed_at"] is not None
    assert row["attempts"] == 1
    return str(row["last_error"])


def relay_name(env: TestEnv, label: str) -> str:
    return f"{env.name}-{label}"


@asynccontextmanager
async def relay(
    env: TestEnv,
    label: str = "relay",
    *,
    poll: float = NEVER_POLLS,
    batch_size: int = 100,
    publish_limit: float = 30.0,
    server_settings: dict[str, str] | None = None,
) -> AsyncIterator[Metrics]:
    """A relay on a broker connection of its own (confirms, mandatory publishes, as the
    service's publishing channel), its database sessions named ``<test>-<label>``."""
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        publisher = await Publisher.on(channel, confirm_within=timedelta(seconds=10))
        metrics = Metrics(CollectorRegistry(), [])

        async def connect() -> asyncpg.Connection[Any]:
            return await asyncpg.connect(
                env.database_url,
                server_settings={
                    "application_name": relay_name(env, label),
                    **(server_settings or {}),
                },
            )

        config = RelayConfig(
            exchange=env.settings().exchange,
            batch_size=batch_size,
            poll=poll,
            reconnect_max_delay=1.0,
            publish_limit=publish_limit,
        )
        async with OutboxRelay(
            config,
            connect=connect,
            publisher=lambda: publisher,
            logger=make_logger(label, log_format="console", stream=io.StringIO()),
            metrics=metrics,
        ):
            yield metrics
    finally:
        await connection.close()


async def test_committed_rows_are_published_to_the_ingress_exchange_and_marked_sent(
    env: TestEnv,
) -> None:
    # Given the topology and a relay that never polls
    await env.apply_topology()
    async with relay(env) as metrics:
        conn = await asyncpg.connect(env.database_url)
        try:
            # When a transaction commits two rows, and once they are sent, another commits one
            async with conn.transaction():
                first = await enqueue(conn, {"sku": "A", "qty": 1}, headers={"source": "test"})
                second = await enqueue(conn, {"sku": "B", "qty": 2})
            await wait_until(lambda: sent(env, second), what="the first commit's rows sent")
            third = await enqueue(conn, {"sku": "C", "qty": 3})
            # Then the commit's notification wakes the relay: published long before any poll
            await wait_until(lambda: sent(env, third), what="the row of the second commit sent")
            bodies = {
                row["event_id"]: bytes(row["body"])
                for row in await conn.fetch("SELECT event_id, body FROM outbox")
            }
        finally:
            await conn.close()
    # and each arrived in the work queue as it was written: its id, its body, its headers
    messages = await drain_queue(env.amqp_url, env.names.work)
    assert [message.message_id for message in messages] == [str(first), str(second), str(third)]
    for message in messages:
        assert message.body == bodies[uuid.UUID(message.message_id)]
        assert message.routing_key == RESTOCK
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert message.content_type == "application/json"
    # with the shard key a sharded queue hashes, as `consumer publish` sets it (no key: the id)
    assert (messages[0].headers or {}).get("source") == "test"
    assert (messages[0].headers or {}).get(SHARD_KEY) == str(first)
    assert metrics.outbox_published._value.get() == 3


async def test_rows_of_a_rolled_back_transaction_are_never_published(env: TestEnv) -> None:
    # Given a relay
    await env.apply_topology()
    async with relay(env):
        conn = await asyncpg.connect(env.database_url)
        try:
            # When a transaction writes a row and rolls back, and another commits one after it
            transaction = conn.transaction()
            await transaction.start()
            await enqueue(conn, {"sku": "GONE", "qty": 1})
            await transaction.rollback()
            kept = await enqueue(conn, {"sku": "KEPT", "qty": 1})
            await wait_until(lambda: sent(env, kept), what="the committed row sent")
        finally:
            await conn.close()
    # Then only the committed row reached the queue
    messages = await drain_queue(env.amqp_url, env.names.work)
    assert [message.message_id for message in messages] == [str(kept)]


async def test_two_relays_on_one_table_publish_every_row_once_each_key_in_order(
    env: TestEnv,
) -> None:
    # Given 20 transactions of 6 rows each committed, keys interleaved, one after another
    await env.apply_topology()
    keys = ["k0", "k1", "k2", "k3", None]
    written: dict[str | None, list[uuid.UUID]] = {key: [] for key in keys}
    conn = await asyncpg.connect(env.database_url)

    async def commit(transactions: range) -> None:
        for n in transactions:
            async with conn.transaction():
                for m in range(6):
                    key = keys[(n + m) % len(keys)]
                    written[key].append(await enqueue(conn, {"sku": "S", "qty": 1}, key=key))

    try:
        await commit(range(20))
        # When two relays start at once on the same table, with small batches so that they share
        # it, and 20 more transactions commit while they run
        async with relay(env, "one", batch_size=7), relay(env, "two", batch_size=7):
            await commit(range(20, 40))
            # Then every row is sent
            await wait_until(lambda: all_sent(env), timeout=60, what="every row sent")
    finally:
        await conn.close()
    messages = await drain_queue(env.amqp_url, env.names.work)
    published = [uuid.UUID(message.message_id) for message in messages]
    # once each
    assert sorted(published) == sorted(event_id for ids in written.values() for event_id in ids)
    # and each key's rows reached the queue in the order they were written
    position = {event_id: index for index, event_id in enumerate(published)}
    for key in keys[:-1]:
        arrived = sorted(written[key], key=position.__getitem__)
        assert arrived == written[key], f"key {key} out of order"


async def test_the_relay_survives_its_listen_connection_terminated(env: TestEnv) -> None:
    # Given a relay that has sent a row
    await env.apply_topology()
    name = relay_name(env, "relay")
    async with relay(env):
        conn = await asyncpg.connect(env.database_url)
        try:
            before = await enqueue(conn, {"sku": "A", "qty": 1})
            await wait_until(lambda: sent(env, before), what="the first row sent")
            # When its database session is terminated
            (pid,) = [
                row["pid"]
                for row in await conn.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = $1", name
                )
            ]
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)

            async def listening_again() -> bool:
                pids = await conn.fetch(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = $1", name
                )
                return bool(pids) and all(row["pid"] != pid for row in pids)

            await wait_until(listening_again, what="the relay connected again")
            # Then it goes on publishing: rows committed after are sent
            after = [await enqueue(conn, {"sku": "B", "qty": n}) for n in range(1, 4)]
            await wait_until(lambda: all_sent(env), what="the rows committed after sent")
        finally:
            await conn.close()
    messages = await drain_queue(env.amqp_url, env.names.work)
    assert [message.message_id for message in messages] == [str(before), *map(str, after)]


async def test_the_service_relays_while_it_consumes(env: TestEnv) -> None:
    # Given the service with its relay on
    await env.apply_topology()
    service = await ServiceProcess(env, outbox_relay="on").start().wait_ready()
    # When producers publish restocks and transactions write restocks to the outbox, together
    published = restocks(50)
    conn = await asyncpg.connect(env.database_url)
    try:
        async with env.producer() as producer:
            await producer.send_many(published)
        relayed = []
        for _ in range(50):
            async with conn.transaction():
                relayed.append(await enqueue(conn, {"sku": "SKU", "qty": 1}, key="SKU"))
    finally:
        await conn.close()
    # Then every one is applied: the relayed ones published to the ingress exchange, consumed
    await wait_until(lambda: _movements_are(env, 100), timeout=60, what="100 stock movements")
    assert await all_sent(env)
    applied = {
        row["event_id"] for row in await fetch(env.database_url, "SELECT event_id FROM receipts")
    }
    assert applied == {event_id for _, _, event_id in published} | set(relayed)
    await wait_until(
        lambda: service.metric_is("consumer_outbox_published_total", 50),
        what="the relay's count of rows published",
    )
    await service.wait_idle()


async def _movements_are(env: TestEnv, count: int) -> bool:
    return await movements(env.database_url) >= count


async def test_an_unroutable_row_fails_for_good_and_the_rows_after_it_go(env: TestEnv) -> None:
    # Given a relay
    await env.apply_topology()
    async with relay(env) as metrics:
        conn = await asyncpg.connect(env.database_url)
        try:
            # When a row of a type no queue is bound for commits, then a row of its key after it
            lost = await enqueue(conn, {"x": 1}, key="K", event_type="nobody.listens")
            after = await enqueue(conn, {"sku": "A", "qty": 1}, key="K")
            await wait_until(lambda: sent(env, after), what="the row after the unroutable one")
            # Then the unroutable row is failed for good, its error kept, and never sent
            error = await failed_once(conn, lost)
        finally:
            await conn.close()
        assert "could not route 'nobody.listens'" in error
        assert metrics.outbox_refused.labels(kind="permanent")._value.get() == 1
    messages = await drain_queue(env.amqp_url, env.names.work)
    assert [message.message_id for message in messages] == [str(after)]


async def test_a_handler_s_follow_ups_are_relayed_and_applied_once(env: TestEnv) -> None:
    # Given the service, its relay on, with a handler that publishes three follow-up events
    env.overrides["handlers"] = f"{TEST_HANDLERS},tests.handlers.outboxing"
    await env.apply_topology()
    service = await ServiceProcess(env, outbox_relay="on").start().wait_ready()
    # When an event comes, and a copy of it after it is applied
    async with env.producer() as producer:
        cause = await producer.send("test.outbox", {"key": "order-1", "count": 3})
        follow_ups = [follow_up_id(cause, env.name, n) for n in range(3)]

        async def chain_applied() -> bool:
            done = await fetchval(
                env.database_url,
                "SELECT count(*) FROM test_effects WHERE event_id = ANY($1::uuid[])",
                [cause, *follow_ups],
            )
            return int(done) == 4

        await wait_until(chain_applied, what="the event and its three follow-ups applied")
        await producer.send("test.outbox", {"key": "order-1", "count": 3}, event_id=cause)
    duplicate = {"type": "test.outbox", "outcome": "duplicate"}
    copy_acked = partial(service.metric_is, "consumer_messages_total", 1, **duplicate)
    await wait_until(copy_acked, what="the copy acked as a duplicate")
    await service.wait_idle()
    # Then the follow-ups went through the relay to the consumer, each applied once
    await assert_applied_once(env.database_url, [cause, *follow_ups])
    assert await all_sent(env)
    assert await fetchval(env.database_url, "SELECT count(*) FROM outbox") == 3
