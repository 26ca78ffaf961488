"""Second review: a property that is not UTF-8 decodes to text three times its size, which the
failed event's retry or dead-letter copy cannot encode again.
"""

from __future__ import annotations

import json
import struct
import uuid
from collections.abc import Iterator

import aiormq
import pytest
from pamqp import encode
from pamqp.commands import Basic

from consumer.amqp import headers as h
from consumer.cli.producer import envelope_body
from tests.support import ServiceProcess, TestEnv, behave, drain_queue, wait_until


class _Raw(str):
    """A short string sent as these bytes, as they are (not UTF-8)."""

    raw: bytes = b""


@pytest.fixture
def raw_short_strings() -> Iterator[None]:
    """Let this test process publish a short string that is not UTF-8, as any client may."""
    original = encode._string

    def lenient(encoder: struct.Struct, value: str) -> bytes:
        if isinstance(value, _Raw):
            return encoder.pack(len(value.raw)) + value.raw
        return original(encoder, value)

    encode._string = lenient
    yield
    encode._string = original


def _raw(data: bytes) -> _Raw:
    value = _Raw("raw")
    value.raw = data
    return value


async def publish_raw(env: TestEnv, *messages: tuple[bytes, Basic.Properties]) -> None:
    """Publish to the test's ingress exchange with aiormq (no aio-pika conversions), as
    ``test.behave``."""
    connection = await aiormq.connect(env.amqp_url)
    try:
        channel = await connection.channel()
        for body, properties in messages:
            await channel.basic_publish(
                body,
                exchange=env.settings().exchange,
                routing_key="test.behave",
                properties=properties,
            )
    finally:
        await connection.close()


async def dead_or_exited(
    env: TestEnv, service: ServiceProcess, culprit: uuid.UUID
) -> dict[uuid.UUID, str]:
    """The dead-letter reasons by event id, once ``culprit`` is among them or the service
    exited (the broker's own reason where the service wrote none)."""
    dead: dict[uuid.UUID, str] = {}

    async def settled_or_exited() -> bool:
        for letter in await drain_queue(env.amqp_url, env.names.dead):
            reason = letter.headers.get(h.REASON) or letter.headers.get("x-first-death-reason")
            dead[uuid.UUID(json.loads(letter.body)["event_id"])] = str(reason)
        return not service.running or culprit in dead

    await wait_until(settled_or_exited, timeout=30, what="the event settled or an exit")
    return dead


async def test_a_message_id_that_is_not_utf8_does_not_stop_the_service(
    env: TestEnv, raw_short_strings: None
) -> None:
    """A producer's message_id of 100 bytes that are not UTF-8 decodes (consumer/amqp/wire.py
    ``_short_str``) to 100 replacement characters, 300 bytes: more than a short string holds.
    The event's handler fails for good, its dead-letter copy carries the message_id, and pamqp
    refuses to encode it (TypeError), which ``Publisher.publish`` does not catch: the worker died
    and the process exited 1, then crash-looped on the redelivery (a graceful stop clears its
    marks), returning everything it held each time."""
    settings = {"batch_size": "50", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit = uuid.uuid4()
    body = envelope_body("test.behave", behave("bad-id", permanent=True), event_id=culprit)
    await publish_raw(
        env,
        (
            body,
            Basic.Properties(
                content_type="application/json", delivery_mode=2, message_id=_raw(b"\xff" * 100)
            ),
        ),
    )
    service = ServiceProcess(env, **settings).start()
    dead = await dead_or_exited(env, service, culprit)
    code = service.returncode
    assert code is None, f"the service exited ({code}): {service.log_tail(1200)}"
    assert dead == {culprit: "permanent_failure"}
    await service.wait_idle()
    await service.stop()


async def test_a_header_that_is_not_utf8_cannot_make_a_copy_too_large_to_publish(
    env: TestEnv, raw_short_strings: None
) -> None:
    """A producer's header value of 50,000 bytes that are not UTF-8 passes the 64 KiB header
    limit (``envelope_parser._header_size`` counts characters), and decodes to 150,000 bytes of
    replacement characters: the failed event's copy no longer fits a frame."""
    settings = {"batch_size": "50", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit = uuid.uuid4()
    body = envelope_body("test.behave", behave("bad-header", permanent=True), event_id=culprit)
    innocent = uuid.uuid4()
    plain = Basic.Properties(content_type="application/json", delivery_mode=2)
    await publish_raw(
        env,
        (
            body,
            Basic.Properties(
                content_type="application/json",
                delivery_mode=2,
                headers={"note": _raw(b"\xff" * 50_000)},
            ),
        ),
        (envelope_body("test.behave", behave("innocent"), event_id=innocent), plain),
    )
    service = ServiceProcess(env, **settings).start()
    dead = await dead_or_exited(env, service, culprit)
    lost = [line for line in service.log_lines() if line.get("event") == "lost RabbitMQ"]
    assert service.returncode is None, service.log_tail(1200)
    assert not lost, f"the connection broke: {lost[:2]}"
    assert culprit in dead
    await service.wait_idle()
    await service.stop()
