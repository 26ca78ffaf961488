"""The outbox's writing half on the real broker and database: what handlers publish
(``event.publish``) is written in their own transaction, once, under derived ids; what an
application enqueues commits or rolls back with its transaction."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import pytest

from consumer.amqp import headers as h
from consumer.db.pruning import ReceiptPruner
from consumer.db.retention import ReceiptWindow
from consumer.envelope import envelope_body
from consumer.errors import OutboxMisuse
from consumer.outbox import enqueue, follow_up_id
from consumer.testing import event, fresh_database, harness
from tests.support import (
    TEST_HANDLERS,
    ServiceProcess,
    TestEnv,
    drain_queue,
    fetch,
    fetchval,
    queue_depth,
    run_cli,
    wait_until,
)

HANDLERS = f"{TEST_HANDLERS},tests.handlers.outboxing"


async def _start(env: TestEnv, **overrides: str) -> ServiceProcess:
    return await ServiceProcess(env, **overrides).start().wait_ready()


async def _use_outboxing(env: TestEnv) -> None:
    env.overrides["handlers"] = HANDLERS
    await env.apply_topology()


async def _rows(env: TestEnv, cause: uuid.UUID) -> list[asyncpg.Record]:
    return await fetch(
        env.database_url,
        "SELECT event_id, type, order_key, body, headers, caused_by, caused_by_consumer, "
        "sent_at FROM outbox WHERE caused_by = $1 ORDER BY id",
        cause,
    )


async def _applied(env: TestEnv, event_id: uuid.UUID) -> bool:
    found = await fetchval(
        env.database_url, "SELECT count(*) FROM test_effects WHERE event_id = $1", event_id
    )
    return bool(found)


def _derived(env: TestEnv, cause: uuid.UUID, count: int) -> list[uuid.UUID]:
    return [follow_up_id(cause, env.name, n) for n in range(count)]


async def test_a_handler_that_publishes_three_events_writes_three_rows_once(env: TestEnv) -> None:
    # Given a service whose handler publishes three test.outboxed events
    await _use_outboxing(env)
    service = await _start(env)

    # When an event comes, and then a copy of it (same id and occurred_at)
    async with env.producer() as producer:
        cause = await producer.send("test.outbox", {"key": "order-1", "count": 3})
        await wait_until(lambda: _applied(env, cause), what="the event applied")
        await producer.send("test.outbox", {"key": "order-1", "count": 3}, event_id=cause)
    await wait_until(
        lambda: service.metric_is(
            "consumer_messages_total", 1, type="test.outbox", outcome="duplicate"
        ),
        what="the copy acked as a duplicate",
    )
    await service.wait_idle()

    # Then three rows, and no more: their ids derived from the cause, the consumer, the position
    rows = await _rows(env, cause)
    assert [row["event_id"] for row in rows] == _derived(env, cause, 3)
    assert {(row["type"], row["order_key"], row["caused_by_consumer"]) for row in rows} == {
        ("test.outboxed", "order-1", env.name)
    }
    assert all(row["sent_at"] is None for row in rows)  # no relay yet: they wait for it
    # And each body is the envelope `consumer publish` would send, correlated to its cause
    for n, row in enumerate(rows):
        sent = json.loads(row["body"])
        assert sent["payload"] == {"key": "order-1", "n": n}
        assert bytes(row["body"]) == envelope_body(
            "test.outboxed",
            {"key": "order-1", "n": n},
            event_id=row["event_id"],
            occurred_at=datetime.fromisoformat(sent["occurred_at"]),
            correlation_id=str(cause),
        )
        assert json.loads(row["headers"]) == {}
    assert await fetchval(env.database_url, "SELECT count(*) FROM outbox") == 3

    # And `consumer events show` follows the chain both ways
    shown = run_cli("consumer", "events", "show", str(cause), env=env.env())
    assert shown.returncode == 0, shown.stderr
    caused = [line for line in shown.stdout.splitlines() if line.startswith("caused:")]
    assert [line.split()[1] for line in caused] == [str(row["event_id"]) for row in rows]
    assert all("test.outboxed" in line and "not sent yet" in line for line in caused)
    follow_up = run_cli("consumer", "events", "show", str(rows[0]["event_id"]), env=env.env())
    assert follow_up.returncode == 0, follow_up.stderr  # found: waiting in the outbox
    assert f"caused by:      event {cause} (its handler in {env.name})" in follow_up.stdout


async def test_failed_runs_write_nothing_and_the_run_that_commits_writes_the_same_ids(
    env: TestEnv,
) -> None:
    # Given events whose handler publishes and then fails: once, for good, or by publishing a
    # payload its target's model refuses
    await _use_outboxing(env)
    async with env.producer() as producer:
        once = await producer.send("test.outbox", {"key": "once", "count": 2, "fail_transient": 1})
        for_good = await producer.send(
            "test.outbox", {"key": "never", "count": 2, "permanent": True}
        )
        invalid = await producer.send("test.outbox", {"key": "bad", "count": 1, "invalid": True})

    # When the service applies them
    service = await _start(env)
    await wait_until(lambda: _applied(env, once), what="the retried event applied")

    async def both_dead() -> bool:
        return await queue_depth(env.amqp_url, env.names.dead) == 2

    await wait_until(both_dead, what="two dead letters")
    await service.wait_idle()

    # Then the retried event (its first run published, then failed) has the rows of its
    # second run only, under the ids the first derived too
    rows = await _rows(env, once)
    assert [row["event_id"] for row in rows] == _derived(env, once, 2)
    # And the failed events have none
    assert await _rows(env, for_good) == []
    assert await _rows(env, invalid) == []
    assert await fetchval(env.database_url, "SELECT count(*) FROM outbox") == 2
    # And the invalid publish dead-lettered its cause with its own reason, naming the refusal
    letters = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    by_id = {json.loads(letter.body)["event_id"]: letter for letter in letters}
    assert by_id[str(for_good)].headers[h.REASON] == "permanent_failure"
    refused = by_id[str(invalid)]
    assert refused.headers[h.REASON] == "invalid_publish"
    assert refused.headers[h.ERROR_CLASS] == "InvalidPublish"
    assert "test.outboxed" in str(refused.headers[h.ERROR_MESSAGE])


async def test_a_batch_applied_again_without_its_culprit_writes_the_others_rows_once(
    env: TestEnv,
) -> None:
    # Given a backlog for a batch handler that publishes two events per event, one of them
    # failing for good
    await _use_outboxing(env)
    good = [uuid.uuid4() for _ in range(11)]
    culprit = uuid.uuid4()
    events: list[tuple[str, dict[str, Any], uuid.UUID]] = [
        ("test.outbox_many", {"key": f"k{n}", "count": 2}, event_id)
        for n, event_id in enumerate(good)
    ]
    events.insert(5, ("test.outbox_many", {"key": "c", "count": 2, "permanent": True}, culprit))
    async with env.producer() as producer:
        await producer.send_many(events)

    # When the service takes them in batches
    service = await _start(env, batch_size="20", prefetch="50")

    async def done() -> bool:
        applied = await fetchval(env.database_url, "SELECT count(*) FROM test_effects")
        return applied == len(good) and await queue_depth(env.amqp_url, env.names.dead) == 1

    await wait_until(done, what="the backlog")
    await service.wait_idle()

    # Then a call took several events at once (the batch that failed, rolled back)
    sizes = [row["size"] for row in await fetch(env.database_url, "SELECT size FROM batch_calls")]
    assert max(sizes) > 1
    # And each good event has its two rows, once, under its derived ids; the culprit none
    for event_id in good:
        assert [row["event_id"] for row in await _rows(env, event_id)] == _derived(env, event_id, 2)
    assert await _rows(env, culprit) == []
    assert await fetchval(env.database_url, "SELECT count(*) FROM outbox") == 2 * len(good)


async def test_the_testing_harness_reports_an_invalid_publish_as_its_dead_letter() -> None:
    # Given a team's handler test, in process (consumer.testing runs the service's pipeline)
    handlers = ["tests.handlers.outboxing"]
    async with fresh_database(handlers) as url, harness(handlers, url) as running:
        # When its handler publishes a payload the target's model refuses, or fails after publishing
        invalid, transient = await running.send(
            event("test.outbox", {"key": "x", "invalid": True}),
            event("test.outbox", {"key": "y", "count": 2, "fail_transient": 1}),
        )
        conn = await asyncpg.connect(url)
        try:
            rows = await conn.fetchval("SELECT count(*) FROM outbox")
        finally:
            await conn.close()

    # Then the test sees what the service does: dead-lettered invalid_publish, retried; no row
    assert (invalid.reason, invalid.error_class) == ("invalid_publish", "InvalidPublish")
    assert (transient.kind.value, transient.error_class) == ("retried", "TransientError")
    assert rows == 0


async def test_an_application_enqueue_commits_or_rolls_back_with_its_transaction(
    env: TestEnv,
) -> None:
    conn = await asyncpg.connect(env.database_url)
    try:
        # As the run-time role: what sql/008 grants it is what an enqueue needs
        await conn.execute("SET ROLE consumer_app")
        # Given an application's transaction that enqueues and then fails
        with pytest.raises(RuntimeError):
            await _failing_request(conn)
        # Then no row is left
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 0

        # When one commits
        async with conn.transaction():
            await conn.execute("SELECT 1")  # the application's own effect
            event_id = await enqueue(
                conn,
                "payment.captured",
                {"order": 1},
                key="order-1",
                correlation_id="req-9",
                headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
            )

        # Then one row: the envelope under its id, no cause, its key and headers
        row = await conn.fetchrow("SELECT * FROM outbox")
        assert row is not None
        assert row["event_id"] == event_id
        assert (row["type"], row["order_key"], row["caused_by"]) == (
            "payment.captured",
            "order-1",
            None,
        )
        sent = json.loads(row["body"])
        assert (sent["event_id"], sent["payload"], sent["correlation_id"]) == (
            str(event_id),
            {"order": 1},
            "req-9",
        )
        assert json.loads(row["headers"])["traceparent"].startswith("00-")

        # And outside a transaction it refuses: the row would commit alone
        with pytest.raises(OutboxMisuse):
            await enqueue(conn, "payment.captured", {"order": 2})
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 1
    finally:
        await conn.close()


async def test_a_prune_keeps_the_outbox_partitions_under_the_receipts_retention(
    env: TestEnv,
) -> None:
    # Given the migration's week of past outbox partitions, and an unsent row five days old
    conn = await asyncpg.connect(env.database_url)
    try:
        async with conn.transaction():
            await enqueue(conn, "t.old", {})
        # An UPDATE of the partition key moves the row to the partition of its new created_at.
        await conn.execute("UPDATE outbox SET created_at = now() - interval '5 days'")
        holding = await conn.fetchval("SELECT tableoid::regclass::text FROM outbox")
        before = await _outbox_partitions(conn)
        surely_past = await conn.fetchval("SELECT now() - interval '2 days'")

        # When `consumer receipts prune --dry-run` looks, then a round runs as the run-time role,
        # with a retention of two days
        looked = run_cli(
            "consumer", "receipts", "prune", "--dry-run", env=env.env(receipt_retention="2d")
        )
        assert looked.returncode == 0, looked.stderr
        assert "outbox: would drop" in looked.stdout
        await conn.execute("SET ROLE consumer_app")
        window = ReceiptWindow(
            retention=timedelta(days=2),
            margin=timedelta(hours=1),
            partition=timedelta(hours=1),
            prune_interval=timedelta(minutes=10),
        )
        # (four days of future skew: partitions are due further ahead than the migration's three)
        report = await ReceiptPruner(window, max_future_skew=timedelta(days=4)).prune(conn)

        # Then the outbox's partitions past it go, but the one that holds the unsent row
        assert report.outbox_ran
        after = await _outbox_partitions(conn)
        gone = set(before) - set(after)
        assert gone == {dropped.partition for dropped in report.outbox_dropped}
        assert {name for name, ends in before.items() if ends <= surely_past} - {holding} <= gone
        assert holding in after
        past = await conn.fetchval("SELECT now() - interval '2 days'")
        assert all(before[name] <= past for name in gone)
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 1
        # And the outbox's partitions are made ahead as the receipts' are
        assert report.outbox_created > 0
        assert max(after.values()) > await conn.fetchval("SELECT now() + interval '4 days'")
    finally:
        await conn.close()


async def _failing_request(conn: asyncpg.Connection[Any]) -> None:
    async with conn.transaction():
        await enqueue(conn, "payment.captured", {"order": 1}, key="order-1")
        raise RuntimeError("the request failed")


async def _outbox_partitions(conn: asyncpg.Connection[Any]) -> dict[str, datetime]:
    rows = await conn.fetch("SELECT name, ends FROM consumer_outbox_partitions")
    return {row["name"]: row["ends"] for row in rows}
