"""A hostile producer's sizes cost only its own message (issue 29): a body over the limit is dropped
as it arrives and dead-lettered whole by the broker; headers over the limits are refused before
they are decoded. Innocent events around them are applied once, nothing is lost, and the
connection never breaks."""

from __future__ import annotations

import asyncio
import json
import struct
import uuid
from collections import Counter
from typing import Any

import aio_pika
import pytest
from aiormq.abc import DeliveredMessage
from aiormq.exceptions import ChannelPreconditionFailed
from pamqp import commands
from pydantic import SecretStr

from bench.hostile import RawTable, flood_table, forged_tables
from consumer.amqp import direct_consume
from consumer.amqp.connect import BrokerConfig, connect
from consumer.cli.producer import envelope_body
from consumer.config.settings import Settings
from tests.servers import ThrowawayRabbit
from tests.support import (
    REPO,
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    drain_queue,
    effect_counts,
    queue_depth,
    run_cli,
    wait_until,
)

MIB = 1024 * 1024
LIMITS_CONF = REPO / "deploy" / "rabbitmq" / "limits.conf"


async def test_a_body_over_the_limit_reaches_the_callback_without_its_body(amqp_url: str) -> None:
    # Given, on a queue, a small body, one of 4 MiB and another small one behind it
    queue = f"ctest_direct_large_{uuid.uuid4().hex[:10]}"
    config = BrokerConfig(urls=(SecretStr(amqp_url),), safe_url=amqp_url, service=queue)
    connection = await connect(config, "consume")
    publisher = await aio_pika.connect(amqp_url)
    bodies = [b"a" * 1000, b"b" * (4 * MIB), b"c" * 300_000]
    try:
        publish_channel = await publisher.channel()
        await publish_channel.declare_queue(queue, durable=False, auto_delete=False)
        for body in bodies:
            await publish_channel.default_exchange.publish(aio_pika.Message(body), queue)
        channel = await connection.channel(publisher_confirms=False)
        underlay = await channel.get_underlay_channel()
        await underlay.basic_qos(prefetch_count=3)
        received: list[DeliveredMessage] = []
        done = asyncio.Event()

        def on_message(message: DeliveredMessage) -> None:
            received.append(message)
            if len(received) == len(bodies):
                done.set()

        # When a direct consumer with a limit of 512 KiB takes them
        await direct_consume.consume_direct(underlay, queue, on_message, max_body_bytes=512 * 1024)
        await asyncio.wait_for(done.wait(), timeout=30)

        # Then the large one arrives without its body, saying how large it was; the others whole
        small, large, after = received
        assert isinstance(large, direct_consume.BodyDiscarded)
        assert large.body == b""
        assert large.header.body_size == 4 * MIB
        assert not isinstance(small, direct_consume.BodyDiscarded)
        assert (small.body, after.body) == (bodies[0], bodies[2])
        await underlay.basic_ack(after.delivery_tag or 0, multiple=True)
    finally:
        cleanup = await publisher.channel()
        await cleanup.queue_delete(queue)
        await publisher.close()
        await connection.close()


def _settled_lines(service: ServiceProcess, reason: str) -> list[dict[str, Any]]:
    return [
        line
        for line in service.log_lines()
        if line.get("event") == "message settled" and line.get("reason") == reason
    ]


def _assert_the_connection_held(service: ServiceProcess) -> None:
    assert not [x for x in service.log_lines() if x.get("event") == "lost RabbitMQ"]


async def test_bodies_over_the_limit_are_dead_lettered_whole_beside_innocent_events(
    env: TestEnv,
) -> None:
    # Given a service whose body limit is 64 KiB, three bodies of 2 MiB (valid events but for
    # their size) among twenty innocent events
    await env.apply_topology()
    service = await ServiceProcess(env, max_body_bytes="65536").start().wait_ready()
    padding = "x" * (2 * MIB)
    large = [
        envelope_body("test.behave", behave(f"large{n}", padding=padding), event_id=uuid.uuid4())
        for n in range(3)
    ]
    innocent = [uuid.uuid4() for _ in range(20)]
    async with env.producer() as producer:
        for number, event_id in enumerate(innocent):
            await producer.send("test.behave", behave(f"v{number}"), event_id=event_id)
            if number % 7 == 3:
                await producer.send_raw(large[number // 7], "test.behave")

    async def settled() -> bool:
        applied = await _effects(env)
        return await queue_depth(env.amqp_url, env.names.dead) >= 3 and applied >= 20

    await wait_until(settled, timeout=60, what="three dead letters and the innocent events")
    await service.wait_idle()

    # Then the innocent events are applied once, the large ones not at all
    await assert_applied_once(env.database_url, innocent)
    # and each large one is in the dead-letter queue whole: the broker dead-lettered the
    # original (rejected), the process having dropped its body unread
    letters = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    assert sorted(letter.body for letter in letters) == sorted(large)
    for letter in letters:
        deaths: Any = letter.headers["x-death"]
        [death] = deaths
        assert death["reason"] == "rejected"
        assert death["queue"] == env.names.work
    lines = _settled_lines(service, "body_too_large")
    assert len(lines) == 3
    assert all(line["error"].endswith("(dropped unread)") for line in lines)
    assert await service.metric("consumer_dead_letters_total", reason="body_too_large") == 3
    _assert_the_connection_held(service)
    assert await service.metric("consumer_in_flight") == 0
    assert await service.stop() == 0


async def _effects(env: TestEnv) -> int:
    return sum((await effect_counts(env.database_url)).values())


def _table(entries: bytes) -> bytes:
    return struct.pack(">I", len(entries)) + entries


def _short(raw: bytes) -> bytes:
    return bytes([len(raw)]) + raw


async def _publish_with_headers(
    env: TestEnv, channel: Any, event_id: uuid.UUID, table: bytes
) -> None:
    properties = commands.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        message_id=str(event_id),
        headers=RawTable(table),
    )
    with forged_tables():
        await channel.basic_publish(
            envelope_body("test.behave", behave(f"hostile-{event_id}"), event_id=event_id),
            exchange=env.settings().exchange,
            routing_key="test.behave",
            properties=properties,
        )


async def test_headers_over_the_limits_are_poison_and_cost_only_their_message(
    env: TestEnv,
) -> None:
    # Given valid events whose headers a producer built by hand: issue 29's flood (60,000
    # entries sharing one key, 120 KB), 1,025 distinct entries in 6 KB, and a key twice
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()
    many = _table(b"".join(_short(str(n).encode()) + b"V" for n in range(1025)))
    key = _short(b"consumer-replays")
    twice = _table(key + b"b\x01" + key + b"b\x02")
    hostile = {uuid.uuid4(): table for table in [flood_table(60_000)] * 5 + [many, twice]}
    innocent = [uuid.uuid4() for _ in range(20)]
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await (await connection.channel()).get_underlay_channel()
        forged = iter(hostile.items())
        async with env.producer() as producer:
            for number, event_id in enumerate(innocent):
                if (hostile_one := next(forged, None)) is not None:
                    await _publish_with_headers(env, channel, *hostile_one)
                await producer.send("test.behave", behave(f"v{number}"), event_id=event_id)
    finally:
        await connection.close()

    async def settled() -> bool:
        applied = await _effects(env)
        return await queue_depth(env.amqp_url, env.names.dead) >= 7 and applied >= 20

    await wait_until(settled, timeout=60, what="seven dead letters and the innocent events")
    await service.wait_idle()

    # Then none of the hostile events is applied, the innocent ones once each
    await assert_applied_once(env.database_url, innocent)
    # and each hostile one is poison with its reason, dead-lettered whole
    assert await service.metric("consumer_dead_letters_total", reason="headers_too_large") == 6
    assert await service.metric("consumer_dead_letters_total", reason="headers_unreadable") == 1
    errors = sorted(line["error"] for line in _settled_lines(service, "headers_too_large"))
    assert errors == ["headers of 120000 bytes, over the limit of 65536"] * 5 + [
        "headers of more than 1024 entries"
    ]
    [unreadable] = _settled_lines(service, "headers_unreadable")
    assert unreadable["error"] == (
        "unreadable headers (the key 'consumer-replays' twice in one table)"
    )
    letters = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    assert sorted(json.loads(letter.body)["event_id"] for letter in letters) == sorted(
        map(str, hostile)
    )
    # and the dead-letter tools say why, though the headers they would read it from are refused
    listed = run_cli("consumer", "dlq", "list", "--json", env=env.env())
    assert listed.returncode == 0, listed.stderr
    reasons = Counter(json.loads(line)["reason"] for line in listed.stdout.splitlines())
    assert reasons == {"headers_too_large": 6, "headers_unreadable": 1}
    _assert_the_connection_held(service)
    assert await service.metric("consumer_redeliveries_total") == 0
    assert await service.metric("consumer_in_flight") == 0
    assert await service.stop() == 0


async def test_the_shipped_broker_limit_refuses_a_larger_body_at_the_door() -> None:
    """deploy/rabbitmq/limits.conf (compose mounts it) on a node of the test's own: RabbitMQ has no
    per-queue cap, only this node-wide one; it matches the consumer's default body limit."""
    lines = [
        line
        for line in LIMITS_CONF.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines == [f"max_message_size = {Settings.model_fields['max_body_bytes'].default}"]
    node = ThrowawayRabbit(lines)
    node.start()
    try:
        connection = await aio_pika.connect(node.url)
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue(exclusive=True)
        limit = int(Settings.model_fields["max_body_bytes"].default)

        await channel.default_exchange.publish(aio_pika.Message(b"x" * limit), queue.name)
        with pytest.raises(ChannelPreconditionFailed) as refused:
            await channel.default_exchange.publish(aio_pika.Message(b"x" * (limit + 1)), queue.name)

        assert "larger than configured max size" in str(refused.value)
        await connection.close()
    finally:
        node.destroy()
