"""``consumer run`` with a queue table: one process, a service per queue, each on its own work
queue, channel, workers and pool. Events of each type are applied once through their own queue;
a queue whose handler stalls or dead-letters without end costs the others nothing; ``--queues``
runs a subset. No timed assertion: rows, queue depths and metrics, waited for."""

from __future__ import annotations

import uuid
from pathlib import Path

import aio_pika

from consumer.amqp import headers as h
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    drain_queue,
    fetchval,
    queue_depth,
    restocks,
    run_cli,
    wait_until,
)

TABLE = """
[queues.stock]
types = ["inventory.restock", "inventory.reserve"]
prefetch = 20

[queues.notify]
types = ["notification.requested"]
prefetch = 10
db_pool_size = 2

[queues.slow]
types = ["test.behave", "test.behave_many", "test.odd"]
prefetch = 1
workers = 1
db_pool_size = 1
handler_timeout = "10m"
hard_timeout = "11m"
retry_delays = "none"
"""


def use_table(env: TestEnv, tmp_path: Path) -> None:
    env.use_queue_table(TABLE, tmp_path)
    applied = run_cli("topology", "apply", env=env.env())
    assert applied.returncode == 0, applied.stderr


def work(env: TestEnv, queue: str) -> str:
    return f"{env.name}.{queue}.work"


async def rows(env: TestEnv, table: str) -> int:
    return int(await fetchval(env.database_url, f"SELECT count(*) FROM {table}"))


async def send_notifications(env: TestEnv, count: int) -> list[uuid.UUID]:
    async with env.producer() as producer:
        return [
            await producer.send(
                "notification.requested", {"recipient": f"r{n}@example.com", "template": "t"}
            )
            for n in range(count)
        ]


async def test_each_type_is_applied_once_through_its_own_queue(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a table of three queues, its topology applied, and the service running it
    use_table(env, tmp_path)
    service = await ServiceProcess(env).start().wait_ready()

    # When events of each queue's types are published
    stock = restocks(30)
    async with env.producer() as producer:
        await producer.send_many(stock)
        effects = [await producer.send("test.behave", behave(f"k{n}")) for n in range(5)]
    notes = await send_notifications(env, 10)

    # Then each is applied exactly once, and every work queue is empty
    async def all_applied() -> bool:
        return (
            await rows(env, "stock_movements") == 30
            and await rows(env, "notifications") == 10
            and await rows(env, "test_effects") == 5
        )

    await wait_until(all_applied, timeout=60, what="every event applied")
    await assert_applied_once(
        env.database_url, [event_id for *_, event_id in stock], "stock_movements"
    )
    await assert_applied_once(env.database_url, notes, "notifications")
    await assert_applied_once(env.database_url, effects, "test_effects")
    assert await rows(env, "receipts") == 45
    for queue in ("stock", "notify", "slow"):
        assert await queue_depth(env.amqp_url, work(env, queue)) == 0

    # And /readyz lists each queue, /metrics labels each queue's series
    status, body = await service.readyz()
    assert status == 200, body
    assert set(body["queues"]) == {"stock", "notify", "slow"}
    assert all(state["ready"] for state in body["queues"].values())
    processed = "consumer_messages_total"
    assert (
        await service.metric(
            processed, type="inventory.restock", outcome="processed", queue="stock"
        )
        == 30
    )
    assert (
        await service.metric(
            processed, type="notification.requested", outcome="processed", queue="notify"
        )
        == 10
    )
    assert await service.stop() == 0


async def test_a_stalled_and_a_dead_lettering_queue_cost_the_others_nothing(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given the service running the table, and its slow queue's only worker held by a handler
    # that awaits far longer than the test, with a second such event waiting behind it
    use_table(env, tmp_path)
    service = await ServiceProcess(env).start().wait_ready()
    async with env.producer() as producer:
        for n in range(2):
            await producer.send("test.behave", behave(f"stall{n}", sleep_s=3600))

    async def slow_is_held() -> bool:
        return await queue_depth(env.amqp_url, work(env, "slow")) == 1

    await wait_until(slow_is_held, timeout=30, what="the slow queue's worker held")

    # When the other queues get their events, and the stock queue a storm of dead letters too
    stock = restocks(40)
    async with env.producer() as producer:
        await producer.send_many(stock)
        for _ in range(20):
            await producer.send("inventory.restock", {"sku": "", "qty": -1})  # invalid: poison
    await send_notifications(env, 15)

    # Then they are all applied, while the slow queue still holds its own
    async def others_applied() -> bool:
        return await rows(env, "stock_movements") == 40 and await rows(env, "notifications") == 15

    await wait_until(others_applied, timeout=60, what="the other queues' events applied")
    await assert_applied_once(
        env.database_url, [event_id for *_, event_id in stock], "stock_movements"
    )
    assert await queue_depth(env.amqp_url, work(env, "slow")) == 1
    assert await rows(env, "test_effects") == 0

    # And the storm's dead letters are the stock queue's, each saying so; no other queue has one
    async def dead_lettered() -> bool:
        return await queue_depth(env.amqp_url, f"{env.name}.stock.dead") == 20

    await wait_until(dead_lettered, timeout=30, what="the poison dead-lettered")
    letters = await drain_queue(env.amqp_url, f"{env.name}.stock.dead")
    assert {(letter.headers or {}).get(h.QUEUE) for letter in letters} == {"stock"}
    assert await queue_depth(env.amqp_url, f"{env.name}.notify.dead") == 0
    assert await queue_depth(env.amqp_url, f"{env.name}.slow.dead") == 0

    # And a graceful stop hands the stalled events back to the slow queue, unapplied
    await service.stop()
    assert await queue_depth(env.amqp_url, work(env, "slow")) == 2


async def test_queues_runs_only_the_queues_it_names(env: TestEnv, tmp_path: Path) -> None:
    # Given the service running only the stock and slow queues of the table
    use_table(env, tmp_path)
    service = await ServiceProcess(env, run_args=("--queues", "stock,slow")).start().wait_ready()

    # When events for every queue are published
    async with env.producer() as producer:
        await producer.send_many(restocks(10))
    await send_notifications(env, 7)

    # Then its queues' events are applied, and the notify queue's wait in its work queue
    async def stock_applied() -> bool:
        return await rows(env, "stock_movements") == 10

    await wait_until(stock_applied, timeout=60, what="the stock queue's events applied")
    assert await queue_depth(env.amqp_url, work(env, "notify")) == 7
    assert await rows(env, "notifications") == 0
    _, body = await service.readyz()
    assert set(body["queues"]) == {"stock", "slow"}
    assert await service.stop() == 0

    # And a name not in the table stops start-up with one line
    result = run_cli("consumer", "run", "--queues", "stock,pay", env=env.env())
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: --queues: no queue 'pay' in queue table ")


async def test_queues_without_a_table_is_one_line(env: TestEnv) -> None:
    result = run_cli("consumer", "run", "--queues", "a", env=env.env())
    assert result.returncode == 2
    assert result.stderr == "error: --queues needs a queue table: set CONSUMER_QUEUES_FILE\n"


async def test_a_missing_queue_topology_stops_the_service_with_one_line(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given the table applied, then one queue's work queue deleted
    use_table(env, tmp_path)
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel()
        await channel.queue_delete(work(env, "notify"))
    finally:
        await connection.close()

    # When the service starts, it stops: the others stop with it
    service = ServiceProcess(env).start()
    assert await service.wait_exit(timeout=60) == 1
    assert "run `consumer topology apply` first" in service.log_text()
