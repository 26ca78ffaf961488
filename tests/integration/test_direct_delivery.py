"""The consume path as the service opens it, on the real broker: frames read in bulk
(:mod:`consumer.amqp.frames`) and deliveries handed over from the channel's reader
(:mod:`consumer.amqp.direct_consume`) arrive whole, in order, with the properties published."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import aio_pika
from aiormq.abc import DeliveredMessage
from pydantic import SecretStr

from consumer.amqp import direct_consume, frames
from consumer.amqp.connect import BrokerConfig, connect
from tests.support import queue_depth, wait_until

# Around the broker's frame_max (128 KiB): bodies of one frame, of exactly one full frame, and of
# several frames (the largest a valid event body may be, 256 KiB, takes three).
BODY_SIZES = [0, 1, 1000, 131_064, 131_065, 262_144, 300_000]


async def test_deliveries_arrive_whole_in_order_with_their_properties(amqp_url: str) -> None:
    queue = f"ctest_direct_{uuid.uuid4().hex[:10]}"
    config = BrokerConfig(urls=(SecretStr(amqp_url),), safe_url=amqp_url, service=queue)
    connection = await connect(config, "consume")
    publisher = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=False)
        underlay = await channel.get_underlay_channel()
        # connect() installed both: the service's consume channel is one of ours.
        assert isinstance(underlay, direct_consume.DirectDeliveryChannel)
        await channel.declare_queue(queue, durable=False, auto_delete=False)
        headers: dict[str, Any] = {"nested": {"deep": [1, "two", {"three": 3.5}]}}
        sent: list[aio_pika.Message] = []
        publish_channel = await publisher.channel()
        for number, size in enumerate(BODY_SIZES):
            message = aio_pika.Message(
                bytes([number % 251]) * size,
                content_type="application/json",
                message_id=f"m-{number}",
                correlation_id=f"c-{number}",
                headers={"n": number, **headers},
                timestamp=datetime(2026, 12, 2, 12, 0, number, tzinfo=UTC),
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            await publish_channel.default_exchange.publish(message, routing_key=queue)
            sent.append(message)

        received: list[DeliveredMessage] = []
        done = asyncio.Event()

        def on_message(message: DeliveredMessage) -> None:
            received.append(message)
            if len(received) == len(BODY_SIZES):
                done.set()

        await underlay.basic_qos(prefetch_count=len(BODY_SIZES))
        await direct_consume.consume_direct(underlay, queue, on_message)
        await asyncio.wait_for(done.wait(), timeout=30)

        for number, (message, got) in enumerate(zip(sent, received, strict=True)):
            assert got.body == message.body, f"body {number} ({BODY_SIZES[number]} bytes)"
            properties = got.header.properties
            assert properties.message_id == f"m-{number}"
            assert properties.correlation_id == f"c-{number}"
            assert properties.content_type == "application/json"
            assert properties.delivery_mode == 2
            assert properties.headers == {"n": number, **headers}
            assert properties.timestamp == datetime(2026, 12, 2, 12, 0, number, tzinfo=UTC)
            assert got.routing_key == queue
        tags = [int(got.delivery_tag or 0) for got in received]
        assert tags == sorted(tags)
        assert len(set(tags)) == len(tags)
        await underlay.basic_ack(tags[-1], multiple=True)
    finally:
        cleanup = await publisher.channel()
        await cleanup.queue_delete(queue)
        await publisher.close()
        await connection.close()


async def test_a_callback_that_raises_closes_the_channel_at_once_and_nothing_is_lost(
    amqp_url: str, caplog: Any
) -> None:
    queue = f"ctest_direct_raise_{uuid.uuid4().hex[:10]}"
    config = BrokerConfig(urls=(SecretStr(amqp_url),), safe_url=amqp_url, service=queue)
    connection = await connect(config, "consume")
    publisher = await aio_pika.connect(amqp_url)
    try:
        publish_channel = await publisher.channel()
        await publish_channel.declare_queue(queue, durable=False, auto_delete=False)
        for number in range(5):
            await publish_channel.default_exchange.publish(
                aio_pika.Message(str(number).encode()), routing_key=queue
            )
        channel = await connection.channel(publisher_confirms=False)
        closed = asyncio.Event()
        channel.close_callbacks.add(lambda *_: closed.set())
        underlay = await channel.get_underlay_channel()
        await underlay.basic_qos(prefetch_count=5)
        seen: list[bytes] = []

        def on_message(message: DeliveredMessage) -> None:
            seen.append(message.body)
            if message.body == b"2":
                raise RuntimeError("a bug in the callback")

        await direct_consume.consume_direct(underlay, queue, on_message)
        # Well before aiormq's ten seconds for a close whose reader has died.
        await asyncio.wait_for(closed.wait(), timeout=5)

        assert underlay.is_closed
        assert not connection.is_closed
        assert b"2" in seen
        assert "delivery callback failed; closing the channel" in caplog.text

        # Nothing was acked: every message comes back to the queue, ready.
        async def all_back() -> bool:
            return await queue_depth(amqp_url, queue) == 5

        await wait_until(all_back, timeout=5, what="the 5 messages back in the queue")
    finally:
        cleanup = await publisher.channel()
        await cleanup.queue_delete(queue)
        await publisher.close()
        await connection.close()


def test_install_puts_the_fast_classes_in_aiormqs_place() -> None:
    import aiormq.connection

    frames.install()
    direct_consume.install()
    assert aiormq.connection.FrameReceiver is frames.BulkFrameReceiver
    assert aiormq.connection.Channel is direct_consume.DirectDeliveryChannel  # type: ignore[attr-defined]
