"""``consumer topology migrate`` from a service without a queue table to one with a table
(``--from-queues-file none``), and back (``CONSUMER_QUEUES_FILE`` unset, the old table named),
under load while the service rolls over: every event applied exactly once, nothing left in the
queues that left, nothing dead-lettered. No timed assertion: rows, receipts and queue depths,
waited for."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import aio_pika

from consumer.cli.producer import envelope_body
from consumer.cli.topology.migrate import moved_headers
from consumer.config.queue_table import QueueTable, read_queue_table
from consumer.config.startup import load_handlers
from consumer.service.components import table_specs, table_topology
from tests.servers import free_port
from tests.support import (
    Event,
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    connect_any,
    count_rows,
    depth_is,
    drain_queue,
    movements_at_least,
    queue_depth,
    queue_exists,
    queue_of,
    restocks,
    run_cli,
    wait_until,
)
from topology.migrate import run_migration
from topology.steps import Move
from topology.table_migration import plan_table_migration

# The one queue's types shared between two queues, each with a ladder of its own (the service
# without a table has the test environment's, 200ms,400ms,800ms).
TABLE = """
[queues.stock]
types = ["inventory.restock", "inventory.reserve", "notification.requested"]
prefetch = 10
db_pool_size = 2
retry_delays = "300ms"

[queues.behave]
types = ["test.behave", "test.behave_many", "test.odd"]
prefetch = 10
db_pool_size = 2
retry_delays = "250ms,1s"
"""
QUEUES = ("stock", "behave")
OLD_RUNGS = ("retry.200ms", "retry.400ms", "retry.800ms")
EXIT_PENDING = 75


def _table(env: TestEnv, tmp_path: Path) -> Path:
    """The table's file, its topology removed with the test's (not set for every process: the
    service without a table runs beside it)."""
    path = tmp_path / "queues.toml"
    path.write_text(TABLE)
    env.topologies.append(table_topology(read_queue_table(path, env.settings())))
    env.topologies.append(env.topology())
    return path


def _apply(environment: dict[str, str]) -> None:
    applied = run_cli("consumer", "topology", "apply", env=environment)
    assert applied.returncode == 0, applied.stderr


class _Load:
    """Restocks and ``test.behave`` events, some of those failing twice so that a ladder holds
    some of them while the bindings move; paced, and on until stopped."""

    def __init__(self, env: TestEnv) -> None:
        self.env = env
        self.stock: list[Event] = []
        self.behaving: list[Event] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        async with self.env.producer() as producer:
            for number in range(10**6):
                if self.stop.is_set() and len(self.stock) >= 1500:
                    break
                chunk = restocks(50)
                moving = [
                    (
                        "test.behave",
                        behave(f"k{number}.{i}", fail_transient=2 if i % 4 == 0 else 0),
                        uuid.uuid4(),
                    )
                    for i in range(10)
                ]
                await producer.send_many([*chunk, *moving])
                self.stock.extend(chunk)
                self.behaving.extend(moving)
                await asyncio.sleep(0.1)

    async def all_applied(self) -> bool:
        moved = await count_rows(self.env, "stock_movements")
        behaved = await count_rows(self.env, "test_effects")
        return moved >= len(self.stock) and behaved >= len(self.behaving)

    async def assert_applied_once(self) -> None:
        await wait_until(self.all_applied, timeout=180, what="every event applied")
        url = self.env.database_url
        await assert_applied_once(url, [event_id for *_, event_id in self.stock], "stock_movements")
        await assert_applied_once(url, [event_id for *_, event_id in self.behaving])
        assert await count_rows(self.env, "receipts") == len(self.stock) + len(self.behaving)


async def _roll_over(
    load: _Load,
    old: ServiceProcess,
    new: ServiceProcess,
    migrate: Callable[[], Awaitable[tuple[int, str]]],
) -> tuple[str, str]:
    """Under load: the migration run while the old service consumes (it waits for it: exit 75),
    the new service started and the old one stopped, the migration run again. Both outputs."""
    publishing = asyncio.create_task(load.run())
    env = load.env
    await wait_until(lambda: movements_at_least(env.database_url, 200), what="the load to start")

    code, first = await migrate()
    assert code == EXIT_PENDING, first
    assert "pending: " in first
    assert "still has 1 consumers" in first

    await new.start().wait_ready()
    assert await old.stop() == 0
    load.stop.set()
    await publishing

    code, second = await migrate()
    assert code == 0, second
    return first, second


def _migration(environment: dict[str, str], *argv: str) -> Callable[[], Awaitable[tuple[int, str]]]:
    async def run() -> tuple[int, str]:
        done = await asyncio.to_thread(
            run_cli, "consumer", "topology", "migrate", *argv, env=environment, timeout=180
        )
        return done.returncode, done.stdout + done.stderr

    return run


async def test_from_no_table_to_a_table_under_load_each_event_is_applied_once(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given the service without a table, under load
    table = _table(env, tmp_path)
    _apply(env.env())
    old = ServiceProcess(env, label="old")
    await old.start().wait_ready()
    load = _Load(env)

    # When the migration to the table runs while it consumes, and again once the service has
    # rolled over to the table
    new = ServiceProcess(env, label="new", http_port=str(free_port()), queues_file=str(table))
    migrate = _migration(env.env(queues_file=str(table)), "--from-queues-file=none")
    first, second = await _roll_over(load, old, new, migrate)

    # Then the one queue's types went to their queues, what it held with them
    assert (
        "moved test.behave: from the service without a table to queue behave "
        f"({env.name}.behave.work)"
    ) in second
    assert "moved inventory.restock: from the service without a table to queue stock" in second
    assert "migrated: the queue table's plan is in place" in second
    assert f"move the messages of {env.name}.work by event type: " in first

    # And every event is applied exactly once, each type by its own queue at the end
    await load.assert_applied_once()
    assert await new.metric(
        "consumer_messages_total", type="test.behave", outcome="processed", queue="behave"
    )
    assert await new.metric(
        "consumer_messages_total", type="inventory.restock", outcome="processed", queue="stock"
    )

    # And the one queue and its rungs are gone, its dead letters kept (none), nothing dead
    assert not await queue_exists(env.amqp_url, queue_of(env, None))
    for rung in OLD_RUNGS:
        assert not await queue_exists(env.amqp_url, queue_of(env, None, rung))
    assert await queue_depth(env.amqp_url, queue_of(env, None, "dead")) == 0
    for queue in QUEUES:
        assert await queue_depth(env.amqp_url, queue_of(env, queue, "dead")) == 0
        assert await queue_depth(env.amqp_url, queue_of(env, queue)) == 0
    check = run_cli("consumer", "topology", "check", env=env.env(queues_file=str(table)))
    assert check.returncode == 0, check.stdout + check.stderr
    assert await new.stop() == 0


async def test_from_a_table_back_to_no_table_under_load_each_event_is_applied_once(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given the service on a table, under load
    table = _table(env, tmp_path)
    _apply(env.env(queues_file=str(table)))
    old = ServiceProcess(env, label="old", queues_file=str(table))
    await old.start().wait_ready()
    load = _Load(env)

    # When the migration back to no table runs while it consumes, and again once the service
    # has rolled over to no table
    new = ServiceProcess(env, label="new", http_port=str(free_port()))
    migrate = _migration(env.env(), f"--from-queues-file={table}")
    first, second = await _roll_over(load, old, new, migrate)

    # Then every queue of the table went into the one queue
    assert (
        f"moved test.behave: from queue behave to the service without a table ({env.name}.work)"
    ) in second
    assert f"migrated: {env.name}.work is the work queue, without a queue table" in second
    assert f"move the messages of {env.name}.behave.work to exchange {env.name}.redeliver" in (
        first
    )

    # And every event is applied exactly once
    await load.assert_applied_once()
    assert await new.metric("consumer_messages_total", type="test.behave", outcome="processed")

    # And the table's work queues and rungs are gone, their dead letters kept (none)
    for queue in QUEUES:
        assert not await queue_exists(env.amqp_url, queue_of(env, queue))
        assert not await queue_exists(env.amqp_url, queue_of(env, queue, "retry.300ms"))
        assert await queue_depth(env.amqp_url, queue_of(env, queue, "dead")) == 0
    assert await queue_depth(env.amqp_url, queue_of(env, None, "dead")) == 0
    assert await queue_depth(env.amqp_url, queue_of(env, None)) == 0
    check = run_cli("consumer", "topology", "check", env=env.env())
    assert check.returncode == 0, check.stdout + check.stderr
    assert await new.stop() == 0


async def _publish_retry(
    env: TestEnv, event_type: str, payload: dict[str, object], rung: str
) -> None:
    """A retry as a replica without a table publishes it: to its retry exchange, the rung and
    the routing key it first came with in its headers."""
    body = envelope_body(event_type, payload, event_id=uuid.uuid4(), occurred_at=datetime.now(UTC))
    headers = {"consumer-retry-rung": rung, "consumer-original-routing-key": event_type}
    async with env.producer() as producer:
        await producer.send_raw(body, event_type, headers=headers, exchange=f"{env.name}.retry")


async def test_an_old_replicas_retry_is_routed_by_type_then_the_rollback_restores_the_queue(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given the service without a table's topology, and events of both queues' types waiting
    # in its work queue, no service running
    table = _table(env, tmp_path)
    _apply(env.env())
    async with env.producer() as producer:
        for n in range(5):
            await producer.send("test.behave", behave(f"waiting{n}"))
            await producer.send("inventory.restock", {"sku": "SKU", "qty": 1})
    await wait_until(lambda: depth_is(env, None, 10), what="the events in the one queue")
    migrate = ("consumer", "topology", "migrate", "--from-queues-file=none")
    table_env = env.env(queues_file=str(table))

    # When it is migrated to the table (no one consumes the one queue: nothing to wait for)
    forth = run_cli(*migrate, env=table_env)

    # Then what the one queue held went, type by type, to the queue that takes it now
    assert forth.returncode == 0, forth.stdout + forth.stderr
    (moved,) = [line for line in forth.stdout.splitlines() if f"of {env.name}.work by" in line]
    assert moved.endswith(": moved 10")
    assert await queue_depth(env.amqp_url, queue_of(env, "behave")) == 5
    assert await queue_depth(env.amqp_url, queue_of(env, "stock")) == 5

    # And a retry an old replica publishes to its ladder reaches the queue its type has now,
    # through that queue's rung
    await _publish_retry(env, "test.behave", behave("retried"), "400ms")
    await _publish_retry(env, "inventory.restock", {"sku": "SKU", "qty": 1}, "800ms")

    async def routed() -> bool:
        return await depth_is(env, "behave", 6) and await depth_is(env, "stock", 6)

    await wait_until(routed, what="each retry in its type's queue")

    # When the migration is rolled back
    back = run_cli(*migrate, "--rollback", env=table_env)

    # Then the one queue is back with what the table's queues held, and takes every type again
    assert back.returncode == 0, back.stdout + back.stderr
    assert f"migrated: {env.name}.work is the work queue, without a queue table" in back.stdout
    assert await queue_depth(env.amqp_url, queue_of(env, None)) == 12
    for queue in QUEUES:
        assert not await queue_exists(env.amqp_url, queue_of(env, queue))
    async with env.producer() as producer:
        await producer.send("test.behave", behave("back"))
    await wait_until(lambda: depth_is(env, None, 13), what="the later event in the one queue")
    # And a retry published to the old ladder goes to its own rung only
    await _publish_retry(env, "test.behave", behave("retried again"), "400ms")
    await wait_until(lambda: depth_is(env, None, 14), what="the retry in the one queue")

    # And the service without a table applies what it holds, nothing dead-lettered
    service = ServiceProcess(env)
    await service.start().wait_ready()

    async def applied() -> bool:
        return await count_rows(env, "receipts") == 14

    await wait_until(applied, timeout=60, what="every event applied")
    assert await service.stop() == 0
    assert await queue_depth(env.amqp_url, queue_of(env, None, "dead")) == 0


async def test_an_old_replicas_retry_while_the_old_rungs_wait_goes_to_one_rung_only(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given the migration to the table run up to its moves: every binding made and removed,
    # the one queue's rungs still there (an old replica still publishing to its ladder)
    table = _table(env, tmp_path)
    _apply(env.env())
    settings = env.settings()
    old = table_specs(QueueTable.default(settings, load_handlers(settings)))
    plan = plan_table_migration(old, table_specs(read_queue_table(table, settings))).plan
    first_move = next(i for i, step in enumerate(plan.steps) if isinstance(step, Move))
    connection = await connect_any(env.amqp_url)
    try:
        await run_migration(
            connection, plan, rewrite_work_headers=moved_headers(), steps=first_move
        )
    finally:
        await connection.close()

    # When an old replica publishes a retry to its 400ms rung, and then a marker goes into that
    # rung behind anything the retry put there
    await _publish_retry(env, "test.behave", behave("retried"), "400ms")
    connection = await connect_any(env.amqp_url)
    try:
        channel = await connection.channel()
        await channel.default_exchange.publish(
            aio_pika.Message(b"{}", message_id="marker"), queue_of(env, None, "retry.400ms")
        )
    finally:
        await connection.close()

    # Then the retry reaches the queue its type has now, through that queue's rung
    await wait_until(lambda: depth_is(env, "behave", 1), what="the retry in its type's queue")
    # And the old rung holds no second copy: when the marker comes out of it into the one
    # queue, nothing came before it
    drained: list[str | None] = []

    async def marker_out() -> bool:
        drained.extend(m.message_id for m in await drain_queue(env.amqp_url, queue_of(env, None)))
        return "marker" in drained

    await wait_until(marker_out, what="the marker through the old rung")
    assert drained == ["marker"]
