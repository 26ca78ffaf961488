"""``consumer topology migrate --from-queues-file``: an event type moved from one queue of the
table to another under load, while the service runs and rolls over to the new table: every event
applied exactly once (the moved type's stragglers and retries by the old queue, the rest by the
new), nothing dead-lettered, and the old queue given none of the moved type afterwards. No timed
assertion: rows, receipts and queue depths, waited for."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from tests.servers import free_port
from tests.support import (
    Event,
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    count_rows,
    depth_is,
    movements_at_least,
    queue_depth,
    queue_exists,
    queue_of,
    restocks,
    run_cli,
    wait_until,
)

# test.behave moves from queue a to queue b; each queue has a ladder of its own.
OLD = """
[queues.a]
types = ["inventory.restock", "inventory.reserve", "test.behave"]
prefetch = 10
db_pool_size = 2
retry_delays = "200ms,1s"

[queues.b]
types = ["notification.requested", "test.behave_many", "test.odd"]
prefetch = 10
db_pool_size = 2
retry_delays = "300ms,600ms"
"""
NEW = OLD.replace(', "test.behave"]', "]").replace(
    '["notification.requested",', '["test.behave", "notification.requested",'
)


def _tables(env: TestEnv, tmp_path: Path) -> tuple[Path, Path]:
    old = env.use_queue_table(OLD, tmp_path)
    new = tmp_path / "new-queues.toml"
    new.write_text(NEW)
    applied = run_cli("topology", "apply", env=env.env())
    assert applied.returncode == 0, applied.stderr
    return old, new


async def test_a_type_moved_between_queues_under_load_is_applied_once_and_lost_nowhere(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given the service on the old table, under load: restocks (queue a, staying), and
    # test.behave events (queue a, moving to b), some failing twice so that a's ladder holds
    # some of them while the bindings move
    old_table, new_table = _tables(env, tmp_path)
    old = ServiceProcess(env, label="old")
    await old.start().wait_ready()
    stock: list[Event] = []
    behaving: list[Event] = []
    stop = asyncio.Event()

    async def load() -> None:
        # Paced, and on until the service has rolled over to the new table: events are
        # published before, while and after the bindings move.
        async with env.producer() as producer:
            for number in range(10**6):
                if stop.is_set() and len(stock) >= 1500:
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
                stock.extend(chunk)
                behaving.extend(moving)
                await asyncio.sleep(0.1)

    publishing = asyncio.create_task(load())
    await wait_until(lambda: movements_at_least(env.database_url, 200), what="the load to start")

    # When the migration runs (the environment holds the new table) while the old service runs
    new_env = env.env(queues_file=str(new_table))
    migrated = await asyncio.to_thread(
        run_cli,
        "consumer",
        "topology",
        "migrate",
        f"--from-queues-file={old_table}",
        env=new_env,
        timeout=120,
    )
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    assert "moved test.behave: from queue a to queue b" in migrated.stdout
    assert "migrated: the queue table's plan is in place" in migrated.stdout

    # And the service rolls over to the new table while the load goes on
    new = ServiceProcess(env, label="new", http_port=str(free_port()), queues_file=str(new_table))
    await new.start().wait_ready()
    assert await old.stop() == 0
    stop.set()
    await publishing

    # Then every event is applied exactly once, through whichever queue it came
    async def all_applied() -> bool:
        return await count_rows(env, "stock_movements") >= len(stock) and await count_rows(
            env, "test_effects"
        ) >= len(behaving)

    await wait_until(all_applied, timeout=180, what="every event applied")
    await assert_applied_once(
        env.database_url, [event_id for *_, event_id in stock], "stock_movements"
    )
    await assert_applied_once(env.database_url, [event_id for *_, event_id in behaving])
    assert await count_rows(env, "receipts") == len(stock) + len(behaving)
    # Both queues carried the moved type: the old one its stragglers, the new one the rest
    assert await new.metric(
        "consumer_messages_total", type="test.behave", outcome="processed", queue="b"
    )

    # And nothing is dead, nothing is left in a queue
    for queue in ("a", "b"):
        assert await queue_depth(env.amqp_url, queue_of(env, queue, "dead")) == 0
        assert await queue_depth(env.amqp_url, queue_of(env, queue)) == 0
    check = run_cli("consumer", "topology", "check", env=new_env)
    assert check.returncode == 0, check.stdout + check.stderr

    # When the service stops and more of the moved type is published
    assert await new.stop() == 0
    async with env.producer() as producer:
        for i in range(20):
            await producer.send("test.behave", behave(f"after{i}"))

    # Then the old queue is given none of it: it waits in its new queue only
    await wait_until(lambda: depth_is(env, "b", 20), what="the events in queue b")
    assert await queue_depth(env.amqp_url, queue_of(env, "a")) == 0


async def test_a_dry_run_and_a_rollback_of_a_moved_type(env: TestEnv, tmp_path: Path) -> None:
    # Given the old table's topology in place
    old_table, new_table = _tables(env, tmp_path)
    new_env = env.env(queues_file=str(new_table))
    migrate = ("consumer", "topology", "migrate", f"--from-queues-file={old_table}")

    # When the migration is dry-run, then run, then rolled back
    dry = run_cli(*migrate, "--dry-run", env=new_env)
    forth = run_cli(*migrate, env=new_env)
    back = run_cli(*migrate, "--rollback", env=new_env)

    # Then the dry run names the move and its steps; the run and the rollback carry them out
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == [
        f"moves test.behave: from queue a to queue b ({env.name}.b.work); "
        f"{env.name}.a.work's consumers apply what it already holds of it",
        f" 1. bind {env.name}.events -> {env.name}.b.work with routing key 'test.behave'",
        f" 2. unbind {env.name}.events -> {env.name}.a.work with routing key 'test.behave'",
    ]
    assert forth.returncode == 0, forth.stdout + forth.stderr
    assert back.returncode == 0, back.stdout + back.stderr
    assert "moved test.behave: from queue b to queue a" in back.stdout
    # And the old table's routing is back: the moved type reaches queue a only
    async with env.producer() as producer:
        await producer.send("test.behave", behave("back"))
    await wait_until(lambda: depth_is(env, "a", 1), what="the event in queue a")
    assert await queue_depth(env.amqp_url, queue_of(env, "b")) == 0


async def test_the_settings_flags_are_refused_with_a_table(env: TestEnv, tmp_path: Path) -> None:
    _, new_table = _tables(env, tmp_path)

    refused = run_cli(
        "consumer",
        "topology",
        "migrate",
        "--from-delivery-limit=5",
        env=env.env(queues_file=str(new_table)),
    )
    missing = run_cli("consumer", "topology", "migrate", env=env.env(queues_file=str(new_table)))

    assert refused.returncode == 2
    assert "--from-delivery-limit: with CONSUMER_QUEUES_FILE" in refused.stderr
    assert missing.returncode == 2
    assert "--from-queues-file OLD.toml" in missing.stderr


async def test_a_queue_leaving_the_table_has_what_it_holds_moved_then_back(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given queue b holding events no one consumes yet, and a new table where a takes b's types
    old_table, _ = _tables(env, tmp_path)
    merged = tmp_path / "merged-queues.toml"
    merged.write_text(
        '[queues.a]\ntypes = ["inventory.restock", "inventory.reserve", "test.behave", '
        '"notification.requested", "test.behave_many", "test.odd"]\nretry_delays = "200ms,1s"\n'
    )
    merged_env = env.env(queues_file=str(merged))
    async with env.producer() as producer:
        waiting = [
            await producer.send("test.odd", {"key": f"o{n}", "name": "x"}) for n in range(30)
        ]
    await wait_until(lambda: depth_is(env, "b", 30), what="the events in queue b")

    # When the migration runs
    migrate = ("consumer", "topology", "migrate", f"--from-queues-file={old_table}")
    merged_run = run_cli(*migrate, env=merged_env)

    # Then b's work queue and rungs are moved into a and deleted; its dead-letter queue stays
    assert merged_run.returncode == 0, merged_run.stdout + merged_run.stderr
    assert (
        f"move the messages of {env.name}.b.work to exchange {env.name}.a.redeliver: moved 30"
        in (merged_run.stdout)
    )
    assert not await queue_exists(env.amqp_url, queue_of(env, "b"))
    assert not await queue_exists(env.amqp_url, queue_of(env, "b", "retry.300ms"))
    assert await queue_exists(env.amqp_url, queue_of(env, "b", "dead"))
    assert await queue_depth(env.amqp_url, queue_of(env, "a")) == 30

    # When it is rolled back: b is declared again, and its types routed to it
    back = run_cli(*migrate, "--rollback", env=merged_env)
    assert back.returncode == 0, back.stdout + back.stderr
    async with env.producer() as producer:
        later = [await producer.send("test.odd", {"key": f"p{n}", "name": "x"}) for n in range(5)]
    await wait_until(lambda: depth_is(env, "b", 5), what="the later events in queue b")

    # Then the service on the old table applies each of them once
    service = ServiceProcess(env)
    await service.start().wait_ready()

    async def applied() -> bool:
        return await count_rows(env, "receipts") == len(waiting) + len(later)

    await wait_until(applied, timeout=60, what="every event applied")
    assert await service.stop() == 0
    for queue in ("a", "b"):
        assert await queue_depth(env.amqp_url, queue_of(env, queue, "dead")) == 0
