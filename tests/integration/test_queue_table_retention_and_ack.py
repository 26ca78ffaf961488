"""A queue table's per-queue receipt retention and acknowledgement timeout, against the real
database and broker (RabbitMQ 3.10 here).

- Each queue's expiry check is its own ``receipt_retention``; the receipts stay one table, kept
  for the longest retention of the table's queues: the pruner never drops what a queue with a
  longer one may still need.
- A queue's ``ack_timeout`` needs a queue argument RabbitMQ honours from 3.12 on: on this broker
  ``consumer topology apply`` and ``consumer run`` refuse it, one line saying what to do, and
  declare nothing.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    fetch,
    fetchval,
    queue_depth,
    queue_exists,
    run_cli,
    wait_until,
)

# The stock queue refuses events older than an hour (2h less the 1h margin); the notify queue
# takes them for the service's week.
TABLE = """
[queues.stock]
types = ["inventory.restock", "inventory.reserve"]
receipt_retention = "2h"

[queues.notify]
types = ["notification.requested"]

[queues.behave]
types = ["test.behave", "test.behave_many", "test.odd"]
"""


async def test_each_queue_expires_by_its_own_retention_and_the_table_keeps_the_longest(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a table whose stock queue keeps receipts 2 hours, and notify the service's 7 days
    env.use_queue_table(TABLE, tmp_path)
    applied = run_cli("topology", "apply", env=env.env())
    assert applied.returncode == 0, applied.stderr
    service = await ServiceProcess(env).start().wait_ready()

    # When an event of each queue, 90 minutes old, arrives
    old = datetime.now(UTC) - timedelta(minutes=90)
    async with env.producer() as producer:
        stock = await producer.send("inventory.restock", {"sku": "SKU", "qty": 1}, occurred_at=old)
        note = await producer.send(
            "notification.requested",
            {"recipient": "r@example.com", "template": "t"},
            occurred_at=old,
        )

    # Then the stock queue dead-letters its own as expired, to its own dead-letter queue
    async def stock_dead() -> bool:
        return await queue_depth(env.amqp_url, f"{env.name}.stock.dead") == 1

    await wait_until(stock_dead, timeout=30, what="the stock event dead-lettered")
    await wait_until(
        lambda: service.metric_is(
            "consumer_dead_letters_total", 1, reason="expired", queue="stock"
        ),
        what="the expired dead letter counted on the stock queue",
    )

    # And the notify queue applies its own, once
    async def noted() -> bool:
        return int(await fetchval(env.database_url, "SELECT count(*) FROM notifications")) == 1

    await wait_until(noted, timeout=30, what="the notification applied")
    await assert_applied_once(env.database_url, [note], "notifications")
    assert await queue_depth(env.amqp_url, f"{env.name}.notify.dead") == 0
    receipts = {row["event_id"] for row in await fetch(env.database_url, "SELECT * FROM receipts")}
    assert receipts == {note}
    assert stock not in receipts
    # And the pruner (at start-up) kept the receipts' days older than the stock queue's 2 hours:
    # the table is kept for the longest retention, the week
    assert await service.metric("consumer_receipt_prunes_total", queue="stock") >= 1
    kept = await fetchval(
        env.database_url,
        "SELECT count(*) FROM consumer_receipt_partitions "
        "WHERE name <> 'receipts_legacy' AND ends <= now() - interval '1 day'",
    )
    assert kept >= 1
    assert await service.stop() == 0

    # And `consumer receipts prune` by hand keeps them too (it reads the table)
    pruned = run_cli("consumer", "receipts", "prune", "--dry-run", env=env.env())
    assert pruned.returncode == 0, pruned.stderr
    assert "nothing older than the retention" in pruned.stdout


ACK_TABLE = """
[queues.stock]
types = ["inventory.restock", "inventory.reserve"]
handler_timeout = "40m"
hard_timeout = "45m"
ack_timeout = "1h"

[queues.notify]
types = ["notification.requested"]

[queues.behave]
types = ["test.behave", "test.behave_many", "test.odd"]
"""


async def test_an_ack_timeout_is_refused_on_a_broker_before_3_12(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a table whose stock queue sets its own acknowledgement timeout, on RabbitMQ 3.10
    env.use_queue_table(ACK_TABLE, tmp_path)

    # Then the plan has it on the stock work queue
    planned = run_cli("topology", "apply", "--dry-run", env=env.env())
    assert planned.returncode == 0, planned.stderr
    assert "x-consumer-timeout=3600000" in planned.stdout

    # When the topology is applied, or the service started
    for command in (("topology", "apply"), ("topology", "check"), ("consumer", "run")):
        result = run_cli(command[0], *command[1:], env=env.env())

        # Then each stops, exit 2, with one line: the version, the queue and what to do
        assert result.returncode == 2, (command, result.stdout, result.stderr)
        (line,) = [text for text in result.stderr.splitlines() if text.startswith("error: ")] or [
            result.stderr
        ]
        assert "error: ack_timeout: RabbitMQ 3.10" in line, line
        assert f"{env.name}.stock.work" in line
        assert "raise consumer_timeout in rabbitmq.conf" in line
        assert "CONSUMER_BROKER_ACK_TIMEOUT" in line
    # And nothing was declared
    for queue in ("stock", "notify", "behave"):
        assert not await queue_exists(env.amqp_url, f"{env.name}.{queue}.work")
