"""Receipts retention: partitions dropped whole, expired events never applied, dedup kept inside
the window, across a prune, between two pruners and across the upgrade from the plain table."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from consumer.db.migration_sets import SERVICE_SET, MigrationSet, service_set
from consumer.db.migrations import migrate
from consumer.db.pruning import ReceiptPruner
from consumer.db.receipts import _INSERT_MANY, _SEAL
from consumer.db.retention import ReceiptWindow
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    drain_queue,
    effect_counts,
    fetch,
    fetchval,
    queue_depth,
    run_cli,
    wait_until,
)

# A short window so that a test can hold events on both sides of it: an hour kept, five minutes
# of margin, partitions of ten minutes.
WINDOW = {"receipt_retention": "1h", "receipt_margin": "5m", "receipt_partition": "10m"}


def cli(env: TestEnv, *args: str) -> tuple[int, str, str]:
    result = run_cli("consumer", *args, env=env.env(**WINDOW))
    return result.returncode, result.stdout, result.stderr


async def test_an_expired_event_is_dead_lettered_with_no_effect_and_replayed_only_forced(
    env: TestEnv,
) -> None:
    # Given a service keeping receipts an hour
    await env.apply_topology()
    service = await ServiceProcess(env, **WINDOW).start().wait_ready()
    # When an event two hours old arrives, and one well inside the window
    async with env.producer() as producer:
        old = await producer.send(
            "test.behave", behave("old"), occurred_at=datetime.now(UTC) - timedelta(hours=2)
        )
        fresh = await producer.send("test.behave", behave("fresh"))

    async def one_dead() -> bool:
        return await queue_depth(env.amqp_url, env.names.dead) == 1

    await wait_until(one_dead, timeout=30, what="the expired event dead-lettered")
    await wait_until(lambda: _applied(env, fresh), timeout=30, what="the fresh event")
    await wait_until(
        lambda: service.metric_is("consumer_dead_letters_total", 1, reason="expired"),
        what="the expired dead letter counted",
    )
    # Then the old one has no effect and no receipt, the fresh one is applied
    await assert_applied_once(env.database_url, [fresh])
    # (the service pruned at start-up: the migration's past days are gone, and it says so)
    assert await service.metric("consumer_receipt_prunes_total") >= 1
    assert await service.metric("consumer_receipts_partitions") == len(await _partitions(env))
    # Late after: the retention, the widest partition kept (the migration's days ahead are a day
    # wide, wider than the 10 minutes set) and two intervals
    widest = await fetchval(
        env.database_url,
        "SELECT extract(epoch FROM max(ends - starts))::float8 FROM consumer_receipt_partitions"
        " WHERE name <> 'receipts_legacy'",
    )
    assert widest == 86400
    late_after = await service.metric("consumer_receipts_prune_late_after_seconds")
    assert late_after == 3600 + widest + 1200
    assert not await fetch(
        env.database_url,
        "SELECT name FROM consumer_receipt_partitions WHERE ends <= now() - interval '1 hour'",
    )
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 1
    code, out, err = cli(env, "dlq", "list", "--json")
    assert code == 0, err
    (letter,) = [json.loads(line) for line in out.splitlines()]
    assert (letter["id"], letter["reason"], letter["error_class"]) == (
        str(old),
        "expired",
        "EventExpired",
    )

    # When it is replayed without --force: refused, saying why, and kept
    code, out, err = cli(env, "dlq", "replay", str(old))
    assert code == 1
    assert "expired" in err
    assert "--force" in err
    assert await queue_depth(env.amqp_url, env.names.dead) == 1
    # With --force it goes back as a new event (occurred_at now, the old one in a header)
    code, out, err = cli(env, "dlq", "replay", "--force", str(old))
    assert code == 0, err
    await wait_until(lambda: _applied(env, old), timeout=30, what="the forced replay applied")
    await assert_applied_once(env.database_url, [fresh, old])
    await service.stop()


async def _applied(env: TestEnv, event_id: uuid.UUID) -> bool:
    return (await effect_counts(env.database_url)).get(event_id, 0) >= 1


async def test_a_duplicate_inside_the_window_is_deduplicated_across_a_prune(env: TestEnv) -> None:
    # Given an event applied 30 minutes after it occurred (inside the hour the prune keeps; the
    # service keeps the default week, so that it leaves the pruning to the command)
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()
    occurred = datetime.now(UTC) - timedelta(minutes=30)
    async with env.producer() as producer:
        event = await producer.send("test.behave", behave("kept"), occurred_at=occurred)
        await wait_until(lambda: _applied(env, event), timeout=30, what="the first copy")
        # When the receipts are pruned: the migration's daily partitions of days past go
        partitions_before = await _partitions(env)
        code, out, err = cli(env, "receipts", "prune", "--dry-run")
        assert code == 0, err
        assert "would drop" in out
        assert await _partitions(env) == partitions_before
        code, out, err = cli(env, "receipts", "prune")
        assert code == 0, err
        assert "dropped receipts_" in out
        assert len(await _partitions(env)) < len(partitions_before)
        # And a copy of the event arrives again
        await producer.send("test.behave", behave("kept"), event_id=event)
    await wait_until(
        lambda: service.metric_is(
            "consumer_messages_total", 1, type="test.behave", outcome="duplicate"
        ),
        what="the copy counted a duplicate",
    )
    # Then it had its effect once
    await assert_applied_once(env.database_url, [event])
    await service.stop()


async def _partitions(env: TestEnv) -> list[str]:
    rows = await fetch(
        env.database_url,
        "SELECT name FROM consumer_receipt_partitions WHERE name <> 'receipts_legacy'",
    )
    return sorted(row["name"] for row in rows)


# -- two pruners, and inserts while they drop ------------------------------------------------


@pytest.fixture
async def app_connections(env: TestEnv) -> AsyncIterator[list[asyncpg.Connection]]:
    """Three connections as the run-time role: it may only call the maintenance functions."""
    connections = [await asyncpg.connect(env.database_url) for _ in range(3)]
    try:
        for conn in connections:
            await conn.execute("SET ROLE consumer_app")
        yield connections
    finally:
        for conn in connections:
            await conn.close()


async def test_two_pruners_at_once_do_not_conflict_nor_block_inserts(
    env: TestEnv, app_connections: list[asyncpg.Connection]
) -> None:
    first, second, inserter = app_connections
    window = ReceiptWindow(
        retention=timedelta(hours=1),
        margin=timedelta(minutes=5),
        partition=timedelta(minutes=10),
        prune_interval=timedelta(minutes=1),
    )
    pruner = ReceiptPruner(window, max_future_skew=timedelta(minutes=5))
    expected = {
        name
        for (name,) in await fetch(
            env.database_url,
            "SELECT name FROM consumer_receipt_partitions WHERE ends <= now() - interval '1 hour'"
            " OR name = 'receipts_legacy'",
        )
    }
    assert len(expected) >= 7  # the migration's past days, and the (empty) legacy table

    # An inserter that may wait at most two seconds for any lock: a prune that held receipts
    # longer, or left it queued behind a lock, fails it.
    await inserter.execute("SET lock_timeout = '2s'")
    stop = asyncio.Event()
    inserted = 0

    async def insert() -> None:
        # The service's own statements: prepared, they lock every partition as they run, the
        # ones being dropped too (a prune that took a partition before receipts would deadlock).
        nonlocal inserted
        while not stop.is_set():
            ids = [uuid.uuid4() for _ in range(5)]
            times = [datetime.now(UTC)] * len(ids)
            async with inserter.transaction():
                await inserter.fetch(_INSERT_MANY, "pruning", ids, ["test.insert"] * 5, times, "2s")
                await inserter.fetchval(_SEAL, len(ids))
            inserted += len(ids)

    inserting = asyncio.create_task(insert())
    while inserted < 50:
        await asyncio.sleep(0.01)
    reports = await asyncio.gather(pruner.prune(first), pruner.prune(second))
    more = inserted + 50
    while inserted < more:
        await asyncio.sleep(0.01)
    stop.set()
    await inserting  # raises if any insert waited past its lock_timeout

    dropped = [item.partition for report in reports for item in report.dropped]
    assert sorted(dropped) == sorted(expected), "each partition dropped once, by one of them"
    assert not set(await _partitions(env)) & expected, "none of the dropped is back"
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == inserted


async def test_pruning_holds_nothing_while_refused_a_lock(
    env: TestEnv, app_connections: list[asyncpg.Connection]
) -> None:
    """A prune that cannot have its lock within its wait fails and keeps everything."""
    first, _, holder = app_connections
    pruner = ReceiptPruner(
        ReceiptWindow(
            timedelta(hours=1), timedelta(minutes=5), timedelta(minutes=10), timedelta(1)
        ),
        max_future_skew=timedelta(minutes=5),
    )
    before = await _partitions(env)
    async with holder.transaction():
        # A long transaction holding receipts (as a slow batch would)
        await holder.execute("SELECT count(*) FROM receipts")
        with pytest.raises(asyncpg.LockNotAvailableError):
            await pruner.prune(first)
    assert await _partitions(env) == before


# -- the upgrade ----------------------------------------------------------------------------


def _set_before_partitions(folder: Path) -> MigrationSet:
    """The service's set as it was before receipts were partitioned (001 to 004)."""
    folder.mkdir()
    for path in sorted(service_set().folder.glob("*.sql")):
        if path.name < "005":
            shutil.copy(path, folder / path.name)
    return MigrationSet(SERVICE_SET, folder)


async def test_the_upgrade_keeps_every_receipt_and_its_dedup(
    empty_database: str, tmp_path: Path
) -> None:
    # Given a database of the release before, holding receipts in the plain table
    conn = await asyncpg.connect(empty_database)
    try:
        await migrate(conn, [_set_before_partitions(tmp_path / "sql")])
        old = [uuid.uuid4() for _ in range(5000)]
        async with conn.transaction():
            await conn.execute("SELECT set_config('consumer.sealed', 'yes', true)")
            await conn.execute(
                "INSERT INTO receipts (consumer, event_id, type)"
                " SELECT 'svc', id, 'test.behave' FROM unnest($1::uuid[]) AS id",
                old,
            )
        # When it is migrated
        report = await migrate(conn, [service_set()])
        assert report.applied[0] == f"{SERVICE_SET}/005_receipts_partitioned_by_occurred_at.sql"
        # Then every receipt is still there, and still makes its event a duplicate
        kept = {row[0] for row in await conn.fetch("SELECT event_id FROM receipts_legacy")}
        assert kept == set(old)
        insert = (
            "INSERT INTO receipts (consumer, event_id, type, occurred_at)"
            " SELECT 'svc', $1, 'test.behave', now()"
            " WHERE NOT EXISTS (SELECT FROM receipts_legacy WHERE consumer = 'svc'"
            " AND event_id = $1) ON CONFLICT DO NOTHING RETURNING true"
        )
        async with conn.transaction():
            await conn.execute("SELECT set_config('consumer.sealed', 'yes', true)")
            assert await conn.fetchval(insert, old[0]) is None  # a duplicate
            assert await conn.fetchval(insert, uuid.uuid4()) is True  # a new event
        # The legacy table goes only once its newest receipt is older than the retention
        pruner = ReceiptPruner(
            ReceiptWindow(timedelta(days=7), timedelta(hours=1), timedelta(days=1), timedelta(1)),
            max_future_skew=timedelta(hours=24),
        )
        report_prune = await pruner.prune(conn)
        assert "receipts_legacy" not in [item.partition for item in report_prune.dropped]
        assert await conn.fetchval("SELECT count(*) FROM receipts_legacy") == len(old)
    finally:
        await conn.close()


async def test_the_service_takes_a_legacy_receipt_for_a_duplicate(env: TestEnv) -> None:
    """The receipt path the service runs (batched and alone) consults the legacy table."""
    event = uuid.uuid4()
    conn = await asyncpg.connect(env.database_url)
    try:
        # As if applied before the upgrade: the row the old table held, moved to the legacy one.
        await conn.execute(
            "INSERT INTO receipts_legacy (consumer, event_id, type) VALUES ($1, $2, 'test.behave')",
            env.name,
            event,
        )
        await conn.execute(
            "UPDATE consumer_receipt_partitions SET ends = NULL WHERE name = 'receipts_legacy'"
        )
    finally:
        await conn.close()
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()
    async with env.producer() as producer:
        await producer.send("test.behave", behave("legacy"), event_id=event)
        other = await producer.send("test.behave", behave("new"))
    await wait_until(
        lambda: service.metric_is(
            "consumer_messages_total", 1, type="test.behave", outcome="duplicate"
        ),
        what="the legacy event counted a duplicate",
    )
    await wait_until(lambda: _applied(env, other), timeout=30, what="the new event")
    await assert_applied_once(env.database_url, [other])
    assert not await drain_queue(env.amqp_url, env.names.dead)
    await service.stop()
