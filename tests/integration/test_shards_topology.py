"""Sharded work queues on the real broker (issue 36, step 1): ``consumer topology apply`` declares
a sharded queue's hash exchange and shard queues, each key lands in one shard and always the same
one, a retry comes back to its own shard, and a broker without the plugin stops ``apply`` with
one line before anything is declared. Consuming the shards: ``test_shards_run.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import aiormq
import pytest

from tests.servers import ThrowawayRabbit, ThrowawayRabbitCluster
from tests.support import (
    REFERENCE_HANDLERS,
    REPO,
    TestEnv,
    drain_queue,
    queue_depth,
    queue_exists,
    run_cli,
    wait_until,
)

SHARDS = 3

TABLE = f"""
[queues.stock]
types = ["inventory.restock", "inventory.reserve"]
shards = {SHARDS}

[queues.notify]
types = ["notification.requested"]

[queues.behave]
types = ["test.behave", "test.behave_many", "test.odd"]
"""


def shard_names(env: TestEnv) -> list[str]:
    return [f"{env.name}.stock.work.s{i}" for i in range(1, SHARDS + 1)]


async def depths(env: TestEnv) -> list[int]:
    return [await queue_depth(env.amqp_url, name) for name in shard_names(env)]


async def send(
    env: TestEnv, routing_key: str, headers: dict[str, str], *, exchange: str | None = None
) -> None:
    async with env.producer() as producer:
        await producer.send_raw(
            json.dumps({"event_id": str(uuid.uuid4())}).encode(),
            routing_key,
            headers=headers,
            exchange=exchange,
        )


def publish_cli(env: TestEnv, sku: str) -> None:
    payload = json.dumps({"sku": sku, "qty": 1})
    published = run_cli(
        "consumer", "publish", "--type", "inventory.restock", "--payload", payload, env=env.env()
    )
    assert published.returncode == 0, published.stderr


async def test_apply_declares_the_shards_and_a_key_always_lands_in_the_same_one(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a table whose stock queue has 3 shards
    env.use_queue_table(TABLE, tmp_path)

    # When the bootstrap applies it
    applied = run_cli("topology", "apply", env=env.env())

    # Then the hash exchange and the shard queues are there, and no unsharded stock work queue
    assert applied.returncode == 0, applied.stderr
    assert (
        f"created exchange {env.name}.stock.hash (x-consistent-hash, durable; "
        "hash-header=consumer-shard-key)"
    ) in applied.stdout.splitlines()
    for name in shard_names(env):
        line = next(row for row in applied.stdout.splitlines() if f"queue {name} " in row)
        assert line.startswith(f"created queue {name} (quorum;"), line
        assert "x-queue-leader-locator=balanced" in line
    assert not await queue_exists(env.amqp_url, f"{env.name}.stock.work")
    assert await queue_exists(env.amqp_url, f"{env.name}.notify.work")

    # And an event published by `consumer publish` lands in one shard, its key's, every time
    publish_cli(env, "SKU-A")
    first = await depths(env)
    assert sorted(first) == [0, 0, 1]
    for _ in range(2):
        publish_cli(env, "SKU-A")
    assert await depths(env) == [3 * depth for depth in first]

    # And so does each of many keys (published as a producer would, the header set), which the
    # shards share between them
    used: set[int] = set()
    for number in range(12):
        before = await depths(env)
        for _ in range(3):
            await send(env, "inventory.reserve", {"consumer-shard-key": f"order-{number}"})
        after = await depths(env)
        grown = [after[i] - before[i] for i in range(SHARDS)]
        assert sorted(grown) == [0, 0, 3], (number, grown)
        used.add(grown.index(3))
    assert len(used) > 1

    # And a type of an unsharded queue still goes to its work queue
    await send(env, "notification.requested", {})
    assert await queue_depth(env.amqp_url, f"{env.name}.notify.work") == 1

    # And applying again is a no-op, and check finds it in place (the leaders need the API)
    again = run_cli("topology", "apply", env=env.env())
    assert again.returncode == 0, again.stderr
    assert "created" not in again.stdout
    check = run_cli("topology", "check", env=env.env())
    assert check.returncode == 0, check.stdout + check.stderr
    assert (
        f"shards: {SHARDS} shard queues; set CONSUMER_MANAGEMENT_URL to see the nodes their "
        "leaders are on"
    ) in check.stdout.splitlines()

    for name in shard_names(env):
        await drain_queue(env.amqp_url, name)
    await drain_queue(env.amqp_url, f"{env.name}.notify.work")


async def test_a_retry_comes_back_to_the_shard_it_came_from(env: TestEnv, tmp_path: Path) -> None:
    # Given the sharded table applied
    env.use_queue_table(TABLE, tmp_path)
    assert run_cli("topology", "apply", env=env.env()).returncode == 0

    # When a retry copy of an event of shard 2 goes into the ladder's first rung, as the service
    # publishes it (the rung, and the shard it was taken from)
    await send(
        env,
        "inventory.reserve",
        {"consumer-retry-rung": "200ms", "consumer-shard": "s2", "consumer-shard-key": "k"},
        exchange=f"{env.name}.stock.retry",
    )

    # Then, its delay over, it is back in shard 2, and in no other
    async def back() -> bool:
        return await depths(env) == [0, 1, 0]

    await wait_until(back, timeout=30, what="the retry back in its shard")
    (message,) = await drain_queue(env.amqp_url, f"{env.name}.stock.work.s2")
    assert message.routing_key == "inventory.reserve"  # as published, for the service's check


async def test_fewer_shards_than_the_broker_has_stop_apply_and_fail_check(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given the stock queue applied with 3 shards, then its table row set to 2
    env.use_queue_table(TABLE, tmp_path)
    assert run_cli("topology", "apply", env=env.env()).returncode == 0
    env.use_queue_table(TABLE.replace(f"shards = {SHARDS}", "shards = 2"), tmp_path)

    # When the bootstrap applies it
    applied = run_cli("topology", "apply", env=env.env())

    # Then it stops, one line, nothing changed: the hash exchange still sends s3 its keys' events
    assert applied.returncode == 1, applied.stdout + applied.stderr
    assert applied.stderr.splitlines() == [
        f"error: {env.name}.stock.work.s3 exists, beyond queue stock's shards = 2: a queue's "
        "shard count changes with `consumer topology migrate --from-queues-file OLD.toml`, "
        "nothing was changed"
    ]

    # And check does not call it in place
    check = run_cli("topology", "check", env=env.env())
    assert check.returncode == 1, check.stdout + check.stderr
    assert (
        f"{env.name}.stock.work.s3 exists, beyond queue stock's shards = 2: a queue's shard "
        "count changes with `consumer topology migrate --from-queues-file OLD.toml`"
    ) in check.stdout.splitlines()
    assert "in place" not in check.stdout


@pytest.fixture
async def plain_rabbit() -> AsyncIterator[ThrowawayRabbit]:
    """A node of the test's own with no plugin enabled: the shared one has the hash exchange."""
    node = ThrowawayRabbit()
    try:
        await asyncio.to_thread(node.start)
        yield node
    finally:
        await asyncio.to_thread(node.destroy)


def bootstrap_env(name: str, url: str, table: Path, shards: int) -> dict[str, str]:
    """The environment of ``consumer topology`` for the reference handlers' types, the stock
    queue with ``shards``, on the broker at ``url``."""
    table.write_text(
        f'[queues.stock]\ntypes = ["inventory.restock", "inventory.reserve"]\nshards = {shards}\n'
        '[queues.notify]\ntypes = ["notification.requested"]\n'
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_")}
    return {
        **base,
        "CONSUMER_NAME": name,
        "CONSUMER_AMQP_URL": url,
        "CONSUMER_HANDLERS": REFERENCE_HANDLERS,
        "CONSUMER_QUEUES_FILE": str(table),
        "PYTHONPATH": str(REPO),
    }


async def test_without_the_plugin_apply_stops_with_one_line_and_declares_nothing(
    plain_rabbit: ThrowawayRabbit, tmp_path: Path
) -> None:
    # Given a broker without rabbitmq_consistent_hash_exchange, and a table with a sharded queue
    table = tmp_path / "queues.toml"
    env = bootstrap_env("noplugin", plain_rabbit.url, table, shards=2)

    # When the bootstrap applies it
    result = run_cli("topology", "apply", env=env)

    # Then it stops, exit 2, with one line naming the plugin
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "error: RabbitMQ has no exchange type x-consistent-hash, which noplugin.stock.hash "
        "needs: enable the plugin rabbitmq_consistent_hash_exchange on every node "
        "(rabbitmq-plugins enable rabbitmq_consistent_hash_exchange), then apply again"
    ]

    # And nothing of the plan was declared, the unsharded queue's part neither
    assert not await queue_exists(plain_rabbit.url, "noplugin.notify.work")
    assert not await queue_exists(plain_rabbit.url, "noplugin.stock.dead")
    connection = await aio_pika.connect(plain_rabbit.url)
    try:
        for name in ("events", "noplugin.stock.dlx", "noplugin.notify.dlx"):
            channel = await connection.channel()
            with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
                await channel.declare_exchange(name, passive=True)
    finally:
        await connection.close()

    # And the same table unsharded applies there
    applied = run_cli(
        "topology", "apply", env=bootstrap_env("noplugin", plain_rabbit.url, table, 1)
    )
    assert applied.returncode == 0, applied.stderr


@pytest.fixture
def cluster() -> Iterator[ThrowawayRabbitCluster]:
    """Three nodes of the test's own, each with the consistent-hash exchange's plugin."""
    nodes = ThrowawayRabbitCluster()
    try:
        nodes.enable_plugins("rabbitmq_consistent_hash_exchange")
        nodes.start()
        yield nodes
    finally:
        nodes.destroy()


@pytest.mark.slow
async def test_apply_puts_the_shards_leaders_on_the_cluster_s_nodes(
    cluster: ThrowawayRabbitCluster, tmp_path: Path
) -> None:
    # Given a three-node cluster and a table whose stock queue has 3 shards, replicated on all
    env = bootstrap_env("spread", cluster.urls[0], tmp_path / "queues.toml", shards=3)
    env["CONSUMER_QUORUM_INITIAL_GROUP_SIZE"] = "3"

    # When the bootstrap applies it, through the first node
    applied = run_cli("topology", "apply", env=env)

    # Then each shard's leader is on a node of its own (balanced: the fewest leaders first),
    # where declaring through one node would have put them all on it
    assert applied.returncode == 0, applied.stderr
    leaders = [
        await asyncio.to_thread(cluster.leader_of, f"spread.stock.work.s{i}") for i in (1, 2, 3)
    ]
    assert sorted(leaders) == [0, 1, 2], leaders
    assert await asyncio.to_thread(cluster.leader_of, "spread.notify.work") == 0
