"""``consumer topology check`` compares the bindings with the plan (read from the management API,
CONSUMER_MANAGEMENT_URL): a missing binding is no longer "in place". A node of the test's own,
with the management plugin (the shared one has none)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika
import aiohttp
import pytest

from tests.deploy.support import RabbitWithPrometheus
from tests.support import REFERENCE_HANDLERS, REFERENCE_TABLE, REPO, run_cli, wait_until

NAME = "check-bindings"
TABLE = REFERENCE_TABLE


@pytest.fixture
async def rabbit() -> AsyncIterator[RabbitWithPrometheus]:
    node = RabbitWithPrometheus()
    try:
        await node.start_async()

        async def answers() -> bool:
            try:
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(
                        f"http://127.0.0.1:{node.management_port}/api/overview",
                        headers={"Authorization": "Basic Z3Vlc3Q6Z3Vlc3Q="},  # guest:guest
                    ) as response,
                ):
                    return response.status == 200
            except aiohttp.ClientError:
                return False

        await wait_until(answers, timeout=60, what="the management API")
        yield node
    finally:
        await node.destroy_async()


def env_for(rabbit: RabbitWithPrometheus, tmp_path: Path, *, management: bool) -> dict[str, str]:
    table = tmp_path / "queues.toml"
    table.write_text(TABLE)
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_")}
    values = {
        **base,
        "CONSUMER_NAME": NAME,
        "CONSUMER_AMQP_URL": rabbit.url,
        "CONSUMER_HANDLERS": REFERENCE_HANDLERS,
        "CONSUMER_QUEUES_FILE": str(table),
        "PYTHONPATH": str(REPO),
    }
    if management:
        url = f"http://guest:guest@127.0.0.1:{rabbit.management_port}"
        values["CONSUMER_MANAGEMENT_URL"] = url
    return values


async def test_check_finds_a_missing_binding(rabbit: RabbitWithPrometheus, tmp_path: Path) -> None:
    # Given the table's topology applied, and the check finding it all in place
    env = env_for(rabbit, tmp_path, management=True)
    applied = run_cli("topology", "apply", env=env)
    assert applied.returncode == 0, applied.stderr
    check = run_cli("topology", "check", env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "topology is in place: exchanges, queues and bindings" in check.stdout

    # When one event type's binding goes (someone unbound it by hand)
    connection = await aio_pika.connect(rabbit.url)
    try:
        channel = await connection.channel()
        queue = await channel.get_queue(f"{NAME}.notify.work")
        await queue.unbind("events", "notification.requested")
    finally:
        await connection.close()

    # Then check names it and fails; it said "in place" before it compared bindings
    check = run_cli("topology", "check", env=env)
    assert check.returncode == 1, check.stdout + check.stderr
    assert (
        f"missing: bind events -> {NAME}.notify.work with routing key 'notification.requested'"
    ) in check.stdout.splitlines()
    assert "in place" not in check.stdout

    # And without the management API it does not vouch for the bindings
    blind = run_cli("topology", "check", env=env_for(rabbit, tmp_path, management=False))
    assert blind.returncode == 0, blind.stdout + blind.stderr
    assert "set CONSUMER_MANAGEMENT_URL to compare the bindings too" in blind.stdout

    # And apply puts the binding back
    assert run_cli("topology", "apply", env=env).returncode == 0
    assert run_cli("topology", "check", env=env).returncode == 0


async def test_an_unreachable_management_api_is_one_line(
    rabbit: RabbitWithPrometheus, tmp_path: Path
) -> None:
    env = env_for(rabbit, tmp_path, management=True)
    assert run_cli("topology", "apply", env=env).returncode == 0
    env["CONSUMER_MANAGEMENT_URL"] = "http://guest:guest@127.0.0.1:1"

    result = run_cli("topology", "check", env=env)

    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: cannot reach the management API at http://127.0.0.1:1")
    assert "guest:guest" not in line


async def test_check_compares_a_sharded_queue_s_bindings_and_names_each_shard_s_leader(
    rabbit: RabbitWithPrometheus, tmp_path: Path
) -> None:
    # Given a table whose stock queue has 2 shards, applied on a node with the hash exchange
    # (deploy/rabbitmq/enabled_plugins)
    env = env_for(rabbit, tmp_path, management=True)
    Path(env["CONSUMER_QUEUES_FILE"]).write_text(
        TABLE.replace('"inventory.reserve"]', '"inventory.reserve"]\nshards = 2')
    )
    applied = run_cli("topology", "apply", env=env)
    assert applied.returncode == 0, applied.stderr

    # When check looks
    check = run_cli("topology", "check", env=env)

    # Then the bindings are in place, and it names the node of each shard's leader
    assert check.returncode == 0, check.stdout + check.stderr
    node = rabbit.node
    assert check.stdout.splitlines() == [
        f"shard {NAME}.stock.work.s1: leader on {node}",
        f"shard {NAME}.stock.work.s2: leader on {node}",
        f"shards: 2 shard queues, leaders on 1 node ({node})",
        "topology is in place: exchanges, queues and bindings",
    ]

    # When a type's binding to the hash exchange and the hash exchange's to a shard go
    connection = await aio_pika.connect(rabbit.url)
    try:
        channel = await connection.channel()
        shard = await channel.get_queue(f"{NAME}.stock.work.s2")
        await shard.unbind(f"{NAME}.stock.hash", "1")
        hashing = await channel.get_exchange(f"{NAME}.stock.hash")
        await hashing.unbind("events", "inventory.reserve")
    finally:
        await connection.close()

    # Then check names both and fails
    check = run_cli("topology", "check", env=env)
    assert check.returncode == 1, check.stdout + check.stderr
    lines = check.stdout.splitlines()
    assert (
        f"missing: bind events -> {NAME}.stock.hash with routing key 'inventory.reserve' (exchange)"
    ) in lines
    assert f"missing: bind {NAME}.stock.hash -> {NAME}.stock.work.s2 with routing key '1'" in lines
    assert "in place" not in check.stdout

    # And apply puts them back
    assert run_cli("topology", "apply", env=env).returncode == 0
    assert run_cli("topology", "check", env=env).returncode == 0

    # When the hash exchange is made again hashing another header (RabbitMQ takes a declaration
    # with other arguments than an exchange has, so apply cannot see it)
    connection = await aio_pika.connect(rabbit.url)
    try:
        channel = await connection.channel()
        await channel.exchange_delete(f"{NAME}.stock.hash")
        await channel.declare_exchange(
            f"{NAME}.stock.hash",
            type=aio_pika.ExchangeType.X_CONSISTENT_HASH,
            durable=True,
            arguments={"hash-header": "order-id"},
        )
    finally:
        await connection.close()
    assert run_cli("topology", "apply", env=env).returncode == 0

    # Then check names the argument and fails
    check = run_cli("topology", "check", env=env)
    assert check.returncode == 1, check.stdout + check.stderr
    assert (
        f"exchange {NAME}.stock.hash: hash-header is order-id, the plan wants consumer-shard-key "
        "(an exchange keeps the arguments it was made with: delete it, then apply)"
    ) in check.stdout.splitlines()


async def test_check_passes_after_a_queue_goes_to_fewer_shards_beside_one_with_more(
    rabbit: RabbitWithPrometheus, tmp_path: Path
) -> None:
    # Given stock with 3 shards and notify with 3, applied, then stock taken to 2 by the
    # migration (which leaves its redirect of s3: an old replica's retry of s3 is hashed)
    env = env_for(rabbit, tmp_path, management=True)
    sharded = TABLE.replace('"inventory.reserve"]', '"inventory.reserve"]\nshards = 3').replace(
        '"notification.requested"]', '"notification.requested"]\nshards = 3'
    )
    old = tmp_path / "queues-old.toml"
    old.write_text(sharded)
    Path(env["CONSUMER_QUEUES_FILE"]).write_text(sharded.replace("shards = 3", "shards = 2", 1))
    applied = run_cli("topology", "apply", env={**env, "CONSUMER_QUEUES_FILE": str(old)})
    assert applied.returncode == 0, applied.stderr
    migrated = run_cli("topology", "migrate", f"--from-queues-file={old}", env=env)
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr

    # When check looks
    check = run_cli("topology", "check", env=env)

    # Then stock's redirect of s3 is not counted against the plan: notify's s3 is not stock's
    assert check.returncode == 0, check.stdout + check.stderr
    assert "topology is in place: exchanges, queues and bindings" in check.stdout
