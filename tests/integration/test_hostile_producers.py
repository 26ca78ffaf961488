"""A hostile producer's message costs only itself: its headers, its properties and the work its
body causes cannot touch the events around it, and the operator's tools cannot be turned on them.
"""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aio_pika
from aio_pika.abc import DeliveryMode
from pamqp import encode

from consumer.amqp import headers as h
from consumer.cli.producer import envelope_body
from tests.support import (
    ServiceProcess,
    TestEnv,
    behave,
    drain_queue,
    fetch,
    queue_depth,
    run_cli,
    wait_until,
)


class _NotUtf8(str):
    """A header value the test producer sends as a long string that is not UTF-8."""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"\xff\xfe not utf-8 \xc3"


class _Double(float):
    """A header value the test producer sends as a double (pamqp sends floats as singles)."""


@contextmanager
def hostile_encoding() -> Iterator[None]:
    """Let the test's own producer put on the wire what a hostile one would."""
    original = encode.encode_table_value

    def table_value(value: Any) -> bytes:
        if isinstance(value, _Double):
            return b"d" + struct.pack(">d", float(value))
        return original(value)

    encode.encode_table_value = table_value
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 50_000))  # to encode a table nested 3,000 deep
    try:
        yield
    finally:
        encode.encode_table_value = original
        sys.setrecursionlimit(limit)


def nested(depth: int) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for _ in range(depth):
        table = {"a": table}
    return table


async def publish(
    env: TestEnv, event_type: str, payload: dict[str, Any], headers: dict[str, Any]
) -> uuid.UUID:
    event_id = uuid.uuid4()
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(env.settings().exchange, ensure=False)
        with hostile_encoding():
            await exchange.publish(
                aio_pika.Message(
                    envelope_body(event_type, payload, event_id=event_id),
                    content_type="application/json",
                    delivery_mode=DeliveryMode.PERSISTENT,
                    headers=headers,
                    message_id=str(event_id),
                ),
                event_type,
                timeout=30,
            )
    finally:
        await connection.close()
    return event_id


async def effects_by_event(env: TestEnv) -> dict[uuid.UUID, int]:
    rows = await fetch(
        env.database_url, "SELECT event_id, count(*) AS n FROM test_effects GROUP BY event_id"
    )
    return {row["event_id"]: row["n"] for row in rows}


async def _effects_at_least(env: TestEnv, expected: int) -> bool:
    return sum((await effects_by_event(env)).values()) >= expected


async def _dead_at_least(env: TestEnv, expected: int) -> bool:
    return await queue_depth(env.amqp_url, env.names.dead) >= expected


def dlq(env: TestEnv, *args: str) -> str:
    result = run_cli("consumer", "dlq", *args, env=env.env())
    assert result.returncode == 0, result.stderr
    return result.stdout


async def test_headers_a_producer_can_send_cost_only_their_own_message(env: TestEnv) -> None:
    # Given, in front of 50 valid events, messages whose headers a client decoder chokes on or
    # cannot send on: a table nested 3,000 deep, an attempt count of 5,000 digits, a string that
    # is not UTF-8 and a double too large for a float (these three on events that fail, so that
    # their headers must travel on to the dead-letter queue)
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()
    deep = await publish(env, "test.behave", behave("deep"), {"x-deep": nested(3000)})
    digits = await publish(
        env, "test.behave", behave("digits", permanent=True), {h.ATTEMPT: "9" * 5000}
    )
    not_utf8 = await publish(
        env, "test.behave", behave("utf8", permanent=True), {"note": _NotUtf8("x")}
    )
    huge = await publish(
        env, "test.behave", behave("huge", permanent=True), {"big": _Double(1e300)}
    )
    valid = [uuid.uuid4() for _ in range(50)]
    async with env.producer() as producer:
        await producer.send_many(("test.behave", behave(f"v{n}"), i) for n, i in enumerate(valid))

    # Then every valid event is applied once, and each hostile message is dead-lettered alone
    await wait_until(lambda: _effects_at_least(env, 50), what="the valid events")
    await wait_until(lambda: _dead_at_least(env, 4), what="four dead letters")
    assert await effects_by_event(env) == dict.fromkeys(valid, 1)
    letters = {row["id"]: row for row in map(json.loads, dlq(env, "list", "--json").splitlines())}
    assert letters[str(deep)]["reason"] == "headers_too_deep"
    for event_id in (digits, not_utf8, huge):
        assert letters[str(event_id)]["reason"] == "permanent_failure"
    # the dead-letter tools read the deep one, and show it escaped
    shown = dlq(env, "show", str(deep))
    assert "headers_too_deep" in shown
    # Nothing broke the connection: no reconnect, no redelivery, nothing left unsettled
    assert not [x for x in service.log_lines() if x.get("event") == "lost RabbitMQ"]
    assert await service.metric("consumer_redeliveries_total") == 0
    assert await service.metric("consumer_in_flight") == 0
    assert await service.stop() == 0


async def test_a_producer_cannot_set_the_services_own_headers(env: TestEnv) -> None:
    # Given a queue elsewhere that a forged routing key would reach, and an event that fails for
    # good carrying forged consumer-* headers
    await env.apply_topology()
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    exchange = await channel.get_exchange(env.settings().exchange, ensure=False)
    elsewhere = await channel.declare_queue(f"{env.name}.payments", exclusive=True)
    await elsewhere.bind(exchange, "payments.#")
    service = await ServiceProcess(env).start().wait_ready()
    forged = {
        h.ORIGINAL_ROUTING_KEY: "payments.refund",
        h.ORIGINAL_EXCHANGE: "payments",
        h.REASON: "all is well",
        h.ERROR_CLASS: "Forged",
        h.ATTEMPT: 2,
    }
    event_id = await publish(env, "test.behave", behave("forged", permanent=True), forged)

    # When it is dead-lettered
    await wait_until(lambda: _dead_at_least(env, 1), what="the dead letter")

    # Then its headers are the service's: the real reason, class, routing key and attempts
    [letter] = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    assert letter.headers[h.REASON] == "permanent_failure"
    assert letter.headers[h.ERROR_CLASS] == "PermanentError"
    assert letter.headers[h.ORIGINAL_ROUTING_KEY] == "test.behave"
    assert letter.headers[h.ORIGINAL_EXCHANGE] == env.settings().exchange
    assert letter.headers[h.ATTEMPT] == 0

    # And a replay goes out with the event's type as its routing key, never the forged one
    dlq(env, "replay", str(event_id))
    await asyncio.sleep(1)
    assert (await elsewhere.get(fail=False)) is None
    await wait_until(lambda: _dead_at_least(env, 1), what="the replay, dead-lettered again")
    await connection.close()
    assert await service.stop() == 0


async def test_the_dead_letter_tools_print_a_producers_bytes_escaped(env: TestEnv) -> None:
    # Given poison whose id, routing key and body carry terminal escape sequences and newlines
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()
    nasty_id = "id\x1b]0;owned\x07\n\x1b[2Jforged line\u202e"
    async with env.producer() as producer:
        await producer.send_raw(
            b'\x1b[2J\x1b]0;title\x07{"not": json\n\x1b[31mred', "test.behave", headers={}
        )
        await producer.send_raw(
            envelope_body("test.behave", {"key": 5}, event_id=uuid.uuid4()), "test.behave"
        )
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    exchange = await channel.get_exchange(env.settings().exchange, ensure=False)
    await exchange.publish(
        aio_pika.Message(b"\x1b[2J{", message_id=nasty_id, headers={"n": "a\nb\x1b[2J"}),
        "test.behave",
    )
    await connection.close()
    await wait_until(lambda: _dead_at_least(env, 3), what="three dead letters")

    # When the operator lists and shows them
    listed = dlq(env, "list")
    shown = dlq(env, "show", nasty_id)

    # Then no control character reaches the terminal, and each letter stays one line
    for output in (listed, shown):
        assert "\x1b" not in output
        assert "\x07" not in output
        assert "\u202e" not in output
    assert "forged line" not in "\n".join(line[:14] for line in listed.splitlines())
    assert "(from the producer)" in shown
    assert "headers set by the producer:" in shown
    assert await service.stop() == 0
