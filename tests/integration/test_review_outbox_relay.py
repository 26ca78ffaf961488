"""Found in review of the outbox relay (issue 34), now regression tests against the real broker
and database. Each test names the defect it was written for."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aio_pika
import asyncpg
import pytest

from consumer import outbox
from consumer.errors import OutboxMisuse
from tests.integration.test_outbox_relay import enqueue, failed_once, relay, sent, unsent
from tests.integration.test_review_blocked_publish import memory_alarm
from tests.servers import ThrowawayRabbit
from tests.support import TestEnv, drain_queue, wait_until


@asynccontextmanager
async def refusing_queue(env: TestEnv, event_type: str) -> AsyncIterator[None]:
    """The only queue bound for ``event_type``: full at a length of 0, with reject-publish
    overflow, so that the broker nacks every publish of the type; deleted afterwards."""
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            f"{env.name}.full",
            durable=True,
            arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
        )
        await queue.bind(env.settings().exchange, routing_key=event_type)
        try:
            yield
        finally:
            await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()


async def test_a_row_whose_headers_amqp_cannot_carry_fails_for_good_and_frees_its_key(
    env: TestEnv,
) -> None:
    # The defect: a header value AMQP has no type for (an integer past 64 bits, which JSON and
    # jsonb take) made every publish of the row raise the encoder's TypeError, which the relay
    # counted as a transient failure: the row was tried again for ever, and every later row of its
    # key was held behind it for ever.
    await env.apply_topology()
    async with relay(env) as metrics:
        conn = await asyncpg.connect(env.database_url)
        try:
            # Given a row of key K whose header no AMQP table can hold, and a row of K after it
            bad = await enqueue(conn, {"sku": "A", "qty": 1}, key="K", headers={"n": 2**70})
            after = await enqueue(conn, {"sku": "B", "qty": 1}, key="K")
            # Then the row after it is sent
            await wait_until(lambda: sent(env, after), what="the row after the unsendable one")
            # and the unsendable one is failed for good, its reason kept, never published
            error = await failed_once(conn, bad)
        finally:
            await conn.close()
        assert "Unsupported numeric value" in error
        assert metrics.outbox_refused.labels(kind="permanent")._value.get() == 1
    messages = await drain_queue(env.amqp_url, env.names.work)
    assert [message.message_id for message in messages] == [str(after)]


async def test_a_round_whose_confirms_a_broker_alarm_holds_back_ends_and_releases_its_rows(
    env: TestEnv, rabbit: ThrowawayRabbit
) -> None:
    # The defect: the publisher waits for a confirm without end while the broker blocks its
    # connection (a memory or disk alarm), and the relay's round waited with it, its transaction
    # open: its rows stayed locked, and the outbox's prune (which needs the table's lock) and the
    # database's vacuum (the transaction's xid) were held back for as long as the alarm lasted.
    # On a throwaway RabbitMQ node of the test's own.
    env = dataclasses.replace(env, amqp_url=rabbit.url, topologies=[])
    env.overrides["exchange"] = f"{env.name}.events"
    await env.apply_topology()
    conn = await asyncpg.connect(env.database_url)
    alarm_on = False
    try:
        async with relay(env, publish_limit=1.0) as metrics:
            # Given a broker alarm that blocks the relay's publishing connection
            memory_alarm(rabbit, on=True)
            alarm_on = True
            # When a row commits
            event_id = await enqueue(conn, {"sku": "A", "qty": 1})

            # Then the round ends while the alarm lasts: the row's attempt counted, unsent
            async def attempted() -> bool:
                attempts = await conn.fetchval(
                    "SELECT attempts FROM outbox WHERE event_id = $1", event_id
                )
                return int(attempts) >= 1

            await wait_until(attempted, timeout=60, what="the blocked round to end")
            assert not await sent(env, event_id)
            assert metrics.outbox_refused.labels(kind="transient")._value.get() >= 1
            # and once the alarm clears, the row is sent
            memory_alarm(rabbit, on=False)
            alarm_on = False
            await wait_until(lambda: sent(env, event_id), timeout=60, what="the row sent")
    finally:
        if alarm_on:
            memory_alarm(rabbit, on=False)
        await conn.close()
    # and it reached the queue (more than once, perhaps: the consumers' receipts absorb copies)
    messages = await drain_queue(env.amqp_url, env.names.work)
    assert {message.message_id for message in messages} == {str(event_id)}


async def test_rows_the_broker_keeps_refusing_do_not_starve_the_rows_behind_them(
    env: TestEnv,
) -> None:
    # The defect: a round claims the first rows owed, in id order. Rows that fail transiently
    # (nacked: a queue full with reject-publish overflow, a quorum queue without its quorum) stay
    # first, so once a whole batch of them had piled up, every round took only them, and the
    # rows behind them (other types, other queues, healthy) were never published for as long as
    # the refusal lasted.
    await env.apply_topology()
    # Given a type whose only queue refuses every publish
    async with refusing_queue(env, "test.full"):
        conn = await asyncpg.connect(env.database_url)
        try:
            async with relay(env, batch_size=3):
                # When more rows of that type than a batch holds commit, then a row of another
                # type, and another of the refused type's key after them
                refused = [await enqueue(conn, {"n": n}, event_type="test.full") for n in range(4)]
                keyed = await enqueue(conn, {"n": 9}, key="F", event_type="test.full")
                healthy = await enqueue(conn, {"sku": "A", "qty": 1})
                # Then the row of the other type is sent while the broker refuses the others
                await wait_until(lambda: sent(env, healthy), what="the healthy row sent")
                attempts = await conn.fetch(
                    "SELECT attempts, sent_at FROM outbox WHERE event_id = ANY($1::uuid[])",
                    [*refused, keyed],
                )
        finally:
            await conn.close()
        assert all(row["sent_at"] is None and row["attempts"] >= 1 for row in attempts)
    messages = await drain_queue(env.amqp_url, env.names.work)
    assert [message.message_id for message in messages] == [str(healthy)]


async def test_the_depth_and_age_are_counted_while_every_round_fails(env: TestEnv) -> None:
    # The defect: the depth and the oldest row's age were counted only after a round that
    # returned. A relay whose every round failed (its session read-only: connected to a standby
    # after a failover; a grant missing) never counted them: the gauges kept their last figure
    # (0, from the start), and OutboxRelayBehind, which reads the age, could not fire while
    # nothing was sent.
    await env.apply_topology()
    conn = await asyncpg.connect(env.database_url)
    try:
        # Given a row owed
        await enqueue(conn, {"sku": "A", "qty": 1})
        # When a relay runs on a read-only session, where a round's claim always fails
        async with relay(env, server_settings={"default_transaction_read_only": "on"}) as metrics:
            # Then the rows owed and the age of the oldest are counted all the same
            async def counted() -> bool:
                depth = float(metrics.outbox_depth._value.get())
                return depth == 1 and float(metrics.outbox_oldest_age._value.get()) > 0

            await wait_until(counted, what="the depth and age counted")
            assert metrics.outbox_relay_errors._value.get() >= 1
    finally:
        await conn.close()
    assert await unsent(env) == 1


async def test_rounds_that_publish_go_on_at_once_whatever_else_the_broker_refuses(
    env: TestEnv,
) -> None:
    # The defect: a round with any row refused (or held for its key) was followed by a wait that
    # doubled with each such round, reset only by a round without one. With rows the broker
    # kept refusing, every round had one, so the rows it could publish went one batch per wait,
    # the wait growing to the poll interval (here ten minutes): a backlog crawled.
    await env.apply_topology()
    # Given a type whose only queue refuses every publish
    async with refusing_queue(env, "test.full"):
        conn = await asyncpg.connect(env.database_url)
        try:
            async with relay(env, batch_size=3):
                # When rows of it and a backlog of other rows, many batches' worth, commit
                async with conn.transaction():
                    for n in range(3):
                        await enqueue(conn, {"n": n}, event_type="test.full")
                    healthy = [await enqueue(conn, {"sku": "A", "qty": n}) for n in range(45)]

                # Then the backlog is sent while the broker refuses the others
                async def backlog_sent() -> bool:
                    return all([await sent(env, event_id) for event_id in healthy])

                await wait_until(backlog_sent, timeout=60, what="the backlog sent")
        finally:
            await conn.close()


async def test_enqueue_refuses_headers_amqp_cannot_carry(env: TestEnv) -> None:
    # The defect's other half: `consumer.outbox.enqueue` took any JSON headers, so the
    # application learnt only from `consumer outbox list --failed` that its row could never be
    # sent. It is told at once now, in its own transaction.
    conn = await asyncpg.connect(env.database_url)
    try:
        async with conn.transaction():
            with pytest.raises(OutboxMisuse, match="header"):
                await outbox.enqueue(conn, "t.bad", {}, headers={"n": 2**70})
            await outbox.enqueue(conn, "t.good", {}, headers={"n": 2**40, "s": "x", "l": [1.5]})
        assert await conn.fetchval("SELECT array_agg(type) FROM outbox") == ["t.good"]
    finally:
        await conn.close()
