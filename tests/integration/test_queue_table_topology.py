"""``consumer topology apply|check`` with a queue table: every queue gets its own work queue,
retry ladder and dead-letter queue, and each event type is routed to its own queue's work queue."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path

import aio_pika

from tests.support import TestEnv, queue_depth, queue_exists, run_cli

TABLE = """
[queues.stock]
types = ["inventory.restock", "inventory.reserve"]
prefetch = 50

[queues.notify]
types = ["notification.requested"]
retry_delays = "1s"
delivery_limit = 5

[queues.behave]
types = ["test.behave", "test.behave_many", "test.odd"]
"""


async def publish(env: TestEnv, event_type: str) -> None:
    body = {
        "event_id": str(uuid.uuid4()),
        "type": event_type,
        "occurred_at": datetime.now(UTC).isoformat(),
        "payload": {},
    }
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(f"{env.name}.events")
        await exchange.publish(
            aio_pika.Message(json.dumps(body).encode()), routing_key=event_type, mandatory=True
        )
    finally:
        await connection.close()


async def test_apply_declares_every_queue_and_routes_each_type_to_its_own(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a table of three queues
    env.use_queue_table(TABLE, tmp_path)

    # When the bootstrap applies it
    applied = run_cli("topology", "apply", env=env.env())

    # Then every queue has its own work queue, ladder and dead-letter queue, under its name
    assert applied.returncode == 0, applied.stderr
    for queue in ("stock", "notify", "behave"):
        for part in ("work", "dead"):
            assert f"created queue {env.name}.{queue}.{part} (quorum" in applied.stdout
    assert f"created queue {env.name}.notify.retry.1s" in applied.stdout
    assert f"created queue {env.name}.stock.retry.200ms" in applied.stdout
    assert not await queue_exists(env.amqp_url, env.names.work)  # no queue-less work queue
    assert "x-delivery-limit=5" in next(
        line for line in applied.stdout.splitlines() if f"{env.name}.notify.work " in line
    )

    # And each type lands in its own queue's work queue
    for event_type in ("inventory.restock", "inventory.reserve", "notification.requested"):
        await publish(env, event_type)
    await publish(env, "test.odd")
    assert await queue_depth(env.amqp_url, f"{env.name}.stock.work") == 2
    assert await queue_depth(env.amqp_url, f"{env.name}.notify.work") == 1
    assert await queue_depth(env.amqp_url, f"{env.name}.behave.work") == 1

    # And applying again is a no-op, and check finds it all in place
    again = run_cli("topology", "apply", env=env.env())
    assert again.returncode == 0, again.stderr
    assert "created" not in again.stdout
    check = run_cli("topology", "check", env=env.env())
    assert check.returncode == 0, check.stdout + check.stderr
    assert "topology is in place" in check.stdout


async def test_check_names_what_one_queue_of_the_table_lacks(env: TestEnv, tmp_path: Path) -> None:
    # Given a table applied, and then one queue's dead-letter queue deleted
    env.use_queue_table(TABLE, tmp_path)
    assert run_cli("topology", "apply", env=env.env()).returncode == 0
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel()
        await channel.queue_delete(f"{env.name}.notify.dead")
    finally:
        await connection.close()

    # When check runs
    result = run_cli("topology", "check", env=env.env())

    # Then it names that queue, and only that one
    assert result.returncode == 1
    assert f"lacks queue {env.name}.notify.dead (" in result.stderr
    assert f"{env.name}.stock" not in result.stderr
