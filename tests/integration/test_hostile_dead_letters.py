"""A producer cannot choose what the dead-letter tools say about its letter: not the reason, the
attempts, the time, nor the routing key; a forged ``expired`` never makes replay refuse it."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
from aio_pika.abc import AbstractQueue, DeliveryMode

from consumer.amqp import headers as h
from consumer.cli.producer import envelope_body
from tests.support import ServiceProcess, TestEnv, behave, queue_depth, run_cli, wait_until

FORGED_AT = "1999-01-01T00:00:00+00:00"
FORGED = {
    h.REASON: "expired",
    h.DEAD_LETTERED_AT: FORGED_AT,
    h.ORIGINAL_ROUTING_KEY: "payments.refund",
    h.ORIGINAL_EXCHANGE: "payments",
    h.ATTEMPT: 3,
    h.ERROR_CLASS: "Forged",
    h.ERROR_MESSAGE: "all is well",
}


def dlq(env: TestEnv, *args: str) -> tuple[int, str, str]:
    result = run_cli("consumer", "dlq", *args, env=env.env())
    return result.returncode, result.stdout, result.stderr


def listed(env: TestEnv, *filters: str) -> list[dict[str, Any]]:
    code, out, err = dlq(env, "list", "--json", *filters)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


async def publish(env: TestEnv, payload: dict[str, Any], headers: dict[str, Any]) -> uuid.UUID:
    """A ``test.behave`` event with ``headers``, as a producer sends it."""
    event_id = uuid.uuid4()
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(env.settings().exchange, ensure=False)
        await exchange.publish(
            aio_pika.Message(
                envelope_body("test.behave", payload, event_id=event_id),
                content_type="application/json",
                delivery_mode=DeliveryMode.PERSISTENT,
                headers=headers,
                message_id=str(event_id),
            ),
            "test.behave",
            timeout=30,
        )
    finally:
        await connection.close()
    return event_id


async def elsewhere(env: TestEnv, channel: aio_pika.abc.AbstractChannel) -> AbstractQueue:
    """A queue a forged routing key would reach through the ingress exchange."""
    exchange = await channel.get_exchange(env.settings().exchange, ensure=False)
    queue = await channel.declare_queue(f"{env.name}.payments", exclusive=True)
    await queue.bind(exchange, "payments.#")
    return queue


def assert_recent(stamp: str | None, started: datetime) -> None:
    assert stamp is not None
    assert datetime.fromisoformat(stamp) >= started - timedelta(seconds=5)


async def test_poison_with_forged_dead_letter_headers_carries_the_service_s_word(
    env: TestEnv,
) -> None:
    # Given poison (a payload its handler refuses) whose producer forged every header the
    # service writes on a dead letter: reason expired, dead-lettered in 1999, another routing key
    await env.apply_topology()
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    payments = await elsewhere(env, channel)
    started = datetime.now(UTC)
    service = await ServiceProcess(env).start().wait_ready()
    event_id = await publish(env, {"key": ""}, FORGED)
    await wait_until(lambda: _dead_are(env, 1), what="the poison in the DLQ")

    # When the operator lists it
    [letter] = listed(env)

    # Then it reads as the service dead-lettered it: its reason, now, no attempts, no forgery
    assert letter["id"] == str(event_id)
    assert letter["reason"] == "invalid_payload"
    assert letter["dead_lettered_by"] == "service"
    assert letter["attempts"] == 0
    assert_recent(letter["dead_lettered_at"], started)
    assert listed(env, "--since", "1h") == [letter]
    assert listed(env, "--reason", "expired") == []
    code, out, _ = dlq(env, "show", str(event_id))
    assert code == 0
    assert "reason:          invalid_payload" in out
    assert "original:        " + f"{env.settings().exchange} test.behave" in out
    assert "payments" not in out
    assert FORGED_AT not in out
    assert "all is well" not in out

    # And a replay needs no --force, and goes out under the event's type, never the forged key
    code, out, err = dlq(env, "replay", str(event_id))
    assert code == 0, out + err
    assert f"replayed {event_id} -> test.behave" in out
    await wait_until(lambda: _dead_are(env, 1), what="the replay, poison again")
    [again] = listed(env)
    assert again["reason"] == "invalid_payload"
    assert (await payments.get(fail=False)) is None
    await connection.close()
    assert await service.stop() == 0


async def test_a_letter_the_broker_dead_lettered_shows_forged_headers_as_unverified(
    env: TestEnv,
) -> None:
    # Given an event with the same forged headers, dead-lettered by the broker at its delivery
    # limit (returned to the work queue until the limit, as by a crash loop)
    await env.apply_topology(delivery_limit="1")
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    payments = await elsewhere(env, channel)
    started = datetime.now(UTC)
    event_id = await publish(env, behave("fine"), FORGED)
    await _return_until_dead_lettered(env, channel)

    # When the operator lists and shows it
    [letter] = listed(env)
    code, out, err = dlq(env, "show", str(event_id))

    # Then its reason, time and routing key are the broker's, none of the forged ones
    assert letter["reason"] == "delivery_limit"
    assert letter["dead_lettered_by"] == "broker"
    assert letter["attempts"] is None
    assert letter["error_class"] is None
    assert_recent(letter["dead_lettered_at"], started)
    assert listed(env, "--since", "1h") == [letter]
    assert listed(env, "--reason", "expired") == []
    assert code == 0, err
    assert "reason:          delivery_limit  (the broker's x-death)" in out
    assert "original:        " + f"{env.settings().exchange} test.behave" in out
    assert "attempts:        ?" in out
    # And the forged headers are shown apart, as unverified, never as the service's
    assert "headers set by the service" not in out
    unverified = out.split("consumer-* headers, unverified")[1].split("headers set by the")[0]
    for key in FORGED:
        assert f"  {key}: " in unverified
    assert "consumer-dead-reason: expired" in unverified

    # And a replay needs no --force, and goes out under the event's type, never the forged key
    code, out, err = dlq(env, "replay", str(event_id))
    assert code == 0, out + err
    assert f"replayed {event_id} -> test.behave" in out
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
    assert await queue_depth(env.amqp_url, env.names.work) == 1
    assert (await payments.get(fail=False)) is None
    await connection.close()


async def _return_until_dead_lettered(env: TestEnv, channel: aio_pika.abc.AbstractChannel) -> None:
    """Take the event from the work queue and give it back until the broker dead-letters it."""
    work = await channel.get_queue(env.names.work, ensure=False)
    for _ in range(10):
        message = await work.get(fail=False, timeout=10)
        if message is None:
            if await queue_depth(env.amqp_url, env.names.dead) == 1:
                return
            await asyncio.sleep(0.1)
            continue
        await message.nack(requeue=True)
    await wait_until(lambda: _dead_are(env, 1), what="the broker's dead letter")


async def _dead_are(env: TestEnv, expected: int) -> bool:
    return await queue_depth(env.amqp_url, env.names.dead) == expected
