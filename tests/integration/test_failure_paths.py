"""Every way a message can fail has one destination: the retry ladder, the DLQ, or the queue."""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import aio_pika
import asyncpg
import pytest
from aio_pika.abc import AbstractIncomingMessage

from consumer.amqp import headers as h
from consumer.db.crashes import CRASH_STRIKES
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    drain_queue,
    fetch,
    fetchval,
    queue_depth,
    restarted_while_it_dies,
    run_cli,
    wait_until,
)

RUNGS = (0.2, 0.4, 0.8)  # the test environment's CONSUMER_RETRY_DELAYS


async def calls(env: TestEnv, event_id: uuid.UUID) -> list[datetime]:
    rows = await fetch(
        env.database_url,
        "SELECT called_at FROM handler_calls WHERE event_id = $1 ORDER BY called_at",
        event_id,
    )
    return [row["called_at"] for row in rows]


async def effects(env: TestEnv, event_id: uuid.UUID) -> int:
    return int(
        await fetchval(
            env.database_url, "SELECT count(*) FROM test_effects WHERE event_id = $1", event_id
        )
    )


async def dead_count(env: TestEnv, expected: int) -> bool:
    return await queue_depth(env.amqp_url, env.names.dead) >= expected


def dlq_json(env: TestEnv, *filters: str, **overrides: str) -> list[dict[str, Any]]:
    result = run_cli("consumer", "dlq", "list", "--json", *filters, env=env.env(**overrides))
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.fixture
async def service(env: TestEnv) -> ServiceProcess:
    await env.apply_topology()
    return await ServiceProcess(env).start().wait_ready()


async def test_two_transient_failures_then_success_is_applied_once_after_two_retries(
    env: TestEnv, service: ServiceProcess
) -> None:
    async with env.producer() as producer:
        event_id = await producer.send("test.behave", behave("flaky", fail_transient=2))

    await wait_until(lambda: _applied(env, event_id), what="the effect")
    seen = await calls(env, event_id)
    assert len(seen) == 3
    waits = [(later - earlier).total_seconds() for earlier, later in itertools.pairwise(seen)]
    for waited, rung in zip(waits, RUNGS, strict=False):
        # The copy waits the rung's TTL in its delay queue; the rest is publish, expiry and
        # redelivery overhead on a shared machine.
        assert rung * 0.9 <= waited <= rung + 1.5, (waits, RUNGS)
    assert await effects(env, event_id) == 1
    assert await service.metric("consumer_retries_published_total", rung="200ms") == 1
    assert await service.metric("consumer_retries_published_total", rung="400ms") == 1
    assert await service.metric("consumer_retries_published_total", rung="800ms") == 0
    assert (
        await service.metric("consumer_messages_total", type="test.behave", outcome="retried") == 2
    )
    assert (
        await service.metric("consumer_messages_total", type="test.behave", outcome="processed")
        == 1
    )
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


async def test_always_transient_ends_in_the_dlq_after_exactly_len_rungs_retries(
    env: TestEnv, service: ServiceProcess
) -> None:
    async with env.producer() as producer:
        event_id = await producer.send("test.behave", behave("down", fail_transient=1000))

    await wait_until(lambda: dead_count(env, 1), timeout=30, what="the dead letter")
    assert len(await calls(env, event_id)) == 1 + len(RUNGS)
    assert await effects(env, event_id) == 0
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 0

    [message] = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    headers = message.headers
    assert headers[h.REASON] == "retries_exhausted"
    assert headers[h.ATTEMPT] == len(RUNGS)
    assert headers[h.ERROR_CLASS] == "TransientError"
    assert "planned failures" in str(headers[h.ERROR_MESSAGE])
    assert headers[h.ORIGINAL_EXCHANGE] == env.names.ingress
    assert headers[h.ORIGINAL_ROUTING_KEY] == "test.behave"
    assert headers[h.SERVICE] == env.name
    assert str(headers[h.FIRST_FAILURE_AT]) < str(headers[h.LAST_FAILURE_AT])
    assert message.routing_key == "test.behave"
    assert json.loads(message.body)["event_id"] == str(event_id)
    assert await service.metric("consumer_dead_letters_total", reason="retries_exhausted") == 1
    assert await service.metric("consumer_retries_published_total", rung="800ms") == 1


async def test_retried_dead_replayed_retried_again_then_applied_is_not_dropped(
    env: TestEnv, service: ServiceProcess
) -> None:
    # Fails four times: the first delivery and all three retries, so it is dead-lettered having
    # passed through every rung. After the replay it fails once more (back through the 200ms
    # rung it already visited: x-death must not follow it) and then succeeds.
    async with env.producer() as producer:
        event_id = await producer.send("test.behave", behave("phoenix", fail_transient=5))
    await wait_until(lambda: dead_count(env, 1), timeout=30, what="the dead letter")

    replayed = run_cli("consumer", "dlq", "replay", str(event_id), env=env.env())
    assert replayed.returncode == 0, replayed.stderr
    assert f"replayed {event_id}" in replayed.stdout

    await wait_until(lambda: _applied(env, event_id), timeout=30, what="the effect after replay")
    assert len(await calls(env, event_id)) == 6
    assert await effects(env, event_id) == 1
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
    assert await service.metric("consumer_retries_published_total", rung="200ms") == 2


@pytest.mark.parametrize(
    ("body", "routing_key", "content_type", "reason", "fast_path"),
    [
        (b"{oops", "test.behave", "application/json", "not_json", "true"),
        (b'{"event_id": "\xc3\x28"}', "test.behave", "application/json", "not_utf8", "true"),
        (
            b'{"event_id": "nope", "type": "test.behave"}',
            "test.behave",
            None,
            "invalid_envelope",
            "true",
        ),
        (None, "test.behave", "text/plain", "wrong_content_type", "true"),
        (None, "test.unregistered", "application/json", "unknown_type", "true"),
        (None, "notification.requested", "application/json", "routing_key_mismatch", "true"),
        (None, "test.behave", "application/json", "invalid_payload", "true"),
        (None, "test.behave", "application/json", "body_too_large", "true"),
        # On aiormq's own code the body is read whole before it is refused: the same letter.
        (None, "test.behave", "application/json", "body_too_large", "false"),
    ],
)
async def test_poison_is_dead_lettered_by_the_service_with_its_reason_counted(
    env: TestEnv,
    body: bytes | None,
    routing_key: str,
    content_type: str | None,
    reason: str,
    fast_path: str,
) -> None:
    await env.apply_topology()
    if reason == "unknown_type":
        # Bound as a handler removed since would leave it: under any other type's routing key
        # it would be routing_key_mismatch.
        await env.bind_type(routing_key)
    service = (
        await ServiceProcess(env, max_body_bytes="2048", amqp_fast_path=fast_path)
        .start()
        .wait_ready()
    )
    event_id = uuid.uuid4()
    if body is None:
        envelope: dict[str, Any] = {
            "event_id": str(event_id),
            "type": "test.behave",
            "occurred_at": datetime.now(UTC).isoformat(),
            "payload": {"key": "k"},
        }
        if reason == "unknown_type":
            envelope["type"] = "test.unregistered"
        if reason == "invalid_payload":
            envelope["payload"] = {"key": ""}
        if reason == "body_too_large":
            envelope["payload"] = {"key": "x" * 4000}
        body = json.dumps(envelope).encode()
    async with env.producer() as producer:
        await producer.send_raw(body, routing_key, content_type=content_type)
        good = await producer.send("test.behave", behave("after the poison"))

    await wait_until(lambda: dead_count(env, 1), what="the poison in the DLQ")
    await wait_until(lambda: _applied(env, good), what="the good event after it")
    [letter] = dlq_json(env, max_body_bytes="2048")
    assert letter["reason"] == reason
    [message] = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    if reason == "body_too_large":
        # Refused on its declared size, its body never held: only the broker's dead-lettering
        # of the original (a nack) can put it in the DLQ, body and all; dlq parses it again.
        assert letter["dead_lettered_by"] == "broker"
        deaths = cast(list[dict[str, Any]], message.headers["x-death"])
        assert deaths[0]["reason"] == "rejected"
        assert message.body == body
    else:
        # a copy the service published (its reason in its headers, confirmed, then the
        # original acked), not the original the broker dead-lettered on a nack
        assert letter["dead_lettered_by"] == "service"
        assert message.headers[h.REASON] == reason
        assert "x-death" not in message.headers
    assert await service.metric("consumer_dead_letters_total", reason=reason) == 1
    assert (
        await service.metric("consumer_messages_total", type="unknown", outcome="poison")
        + (await service.metric("consumer_messages_total", type="test.behave", outcome="poison"))
        == 1
    )
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 1  # the good one
    assert await fetchval(env.database_url, "SELECT count(*) FROM handler_calls") == 1
    assert any(
        line.get("outcome") == "poison" and line.get("reason") == reason
        for line in service.log_lines()
    )


@pytest.mark.parametrize(
    ("spec", "error_class"),
    [
        ({"permanent": True}, "PermanentError"),
        ({"bug": True}, "ZeroDivisionError"),
    ],
)
async def test_permanent_failures_are_dead_lettered_at_once_with_reason_headers(
    env: TestEnv, service: ServiceProcess, spec: dict[str, Any], error_class: str
) -> None:
    async with env.producer() as producer:
        event_id = await producer.send("test.behave", behave("never", **spec))

    await wait_until(lambda: dead_count(env, 1), what="the dead letter")
    assert len(await calls(env, event_id)) == 1
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 0
    [message] = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    assert message.headers[h.REASON] == "permanent_failure"
    assert message.headers[h.ERROR_CLASS] == error_class
    assert message.headers[h.ATTEMPT] == 0
    assert await service.metric("consumer_dead_letters_total", reason="permanent_failure") == 1
    assert await service.metric("consumer_retries_published_total", rung="200ms") == 0


async def test_an_unconfirmed_retry_publish_returns_the_original_never_loses_it(
    env: TestEnv,
) -> None:
    # Given the first rung unreachable: the retry exchange has no binding for it
    topology = await env.apply_topology(delivery_limit="50")
    service = await ServiceProcess(env, delivery_limit="50").start().wait_ready()
    rung = next(q for q in topology.queues if q.name.endswith(".retry.200ms"))
    binding = next(b for b in topology.bindings if b.queue == rung.name)
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    queue = await channel.get_queue(rung.name)
    await queue.unbind(binding.exchange, binding.routing_key, arguments=dict(binding.arguments))

    # When an event fails transiently, its retry copy cannot be routed
    async with env.producer() as producer:
        event_id = await producer.send("test.behave", behave("unroutable", fail_transient=4))

    async def publish_failed() -> bool:
        return await service.metric("consumer_publish_failures_total") >= 2

    await wait_until(publish_failed, what="two failed retry publishes")
    assert await effects(env, event_id) == 0
    assert (
        await service.metric("consumer_messages_total", type="test.behave", outcome="returned") >= 2
    )

    # Then, once the rung is reachable again, the event still gets through, exactly once
    await queue.bind(binding.exchange, binding.routing_key, arguments=dict(binding.arguments))
    await connection.close()
    await wait_until(lambda: _applied(env, event_id), timeout=30, what="the effect")
    assert await effects(env, event_id) == 1
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


@pytest.mark.parametrize("jitter", ["0.5", None])
async def test_jitter_gives_each_retry_copy_an_expiration_within_its_rung(
    env: TestEnv, jitter: str | None
) -> None:
    # Given a one-rung ladder of 30s, long enough to catch the copies in their delay queue, and
    # jitter of 0.5 (or none)
    settings = {"retry_delays": "30s"} | ({"retry_jitter": jitter} if jitter else {})
    await env.apply_topology(**settings)
    service = await ServiceProcess(env, **settings).start().wait_ready()
    rung = env.names.rung(timedelta(seconds=30))

    # When events fail once and their retry copies wait out the rung
    async with env.producer() as producer:
        ids = {
            await producer.send("test.behave", behave(f"jittered-{n}", fail_transient=1))
            for n in range(10)
        }

    async def all_waiting() -> bool:
        return await queue_depth(env.amqp_url, rung) == len(ids)

    await wait_until(all_waiting, what="ten copies in the delay queue")
    copies = await drain_queue(env.amqp_url, rung, ack=False)

    # Then with jitter each copy carries its own expiration, between 15s and the rung's 30s;
    # without, none does (the queue's TTL alone applies)
    assert {uuid.UUID(json.loads(copy.body)["event_id"]) for copy in copies} == ids
    expirations = [_expiration_s(copy) for copy in copies]
    if jitter:
        assert all(e is not None and 30 * (1 - 0.5) <= e <= 30 for e in expirations), expirations
        assert len(set(expirations)) > 1, expirations  # drawn per message
    else:
        assert expirations == [None] * len(ids)
    assert await service.metric("consumer_retries_published_total", rung="30s") == len(ids)
    assert await fetchval(env.database_url, "SELECT count(*) FROM test_effects") == 0


async def test_a_handler_that_kills_its_process_is_named_and_dead_lettered_alone(
    env: TestEnv,
) -> None:
    # Given an event whose handler ends the process (a segfault, an OOM kill), among innocent
    # events published around it
    await env.apply_topology()
    async with env.producer() as producer:
        before = [uuid.uuid4() for _ in range(30)]
        await producer.send_many(("test.behave", behave(f"b{n}"), i) for n, i in enumerate(before))
        crasher = await producer.send("test.behave", behave("segfault", crash=True))
        after = [uuid.uuid4() for _ in range(30)]
        await producer.send_many(("test.behave", behave(f"a{n}"), i) for n, i in enumerate(after))

    # When a supervisor restarts the service each time it dies, as systemd or Kubernetes would
    restarts, _ = await restarted_while_it_dies(env, ServiceProcess(env, "run-0").start(), most=6)

    # Then the culprit alone is dead-lettered, after the deaths it caused applied alone (the
    # first in company, then CRASH_STRIKES alone), and every innocent event is applied once
    assert restarts == 1 + CRASH_STRIKES
    await wait_until(lambda: dead_count(env, 1), what="the dead letter")
    await wait_until(
        lambda: _count(env, "SELECT count(*) FROM test_effects", 60), what="the innocent effects"
    )
    rows = await fetch(
        env.database_url, "SELECT event_id, count(*) AS n FROM test_effects GROUP BY event_id"
    )
    assert {row["event_id"]: row["n"] for row in rows} == dict.fromkeys([*before, *after], 1)
    [letter] = dlq_json(env)
    assert letter["id"] == str(crasher)
    assert letter["reason"] == "crashed"
    assert letter["error_class"] == "CrashedRepeatedly"
    assert await effects(env, crasher) == 0
    left = await fetchval(env.database_url, "SELECT count(*) FROM consumer_in_progress")
    assert left == 0


async def test_graceful_restarts_never_push_a_healthy_message_over_the_limit(env: TestEnv) -> None:
    # Each SIGTERM returns the prefetched, unstarted messages once; with a limit of 3, two
    # restarts must not dead-letter anything.
    await env.apply_topology(delivery_limit="3")
    async with env.producer() as producer:
        ids = [uuid.uuid4() for _ in range(400)]
        await producer.send_many(
            ("test.behave", behave(f"k{n}", sleep_s=0.02), i) for n, i in enumerate(ids)
        )
    for round_ in range(2):
        service = ServiceProcess(
            env, f"round-{round_}", delivery_limit="3", db_pool_size="4"
        ).start()
        await service.wait_ready()
        await asyncio.sleep(0.5)
        assert await service.stop() == 0
    final = await ServiceProcess(env, "final", delivery_limit="3").start().wait_ready()
    await wait_until(
        lambda: _count(env, "SELECT count(*) FROM test_effects", 400),
        timeout=60,
        what="all effects",
    )
    await final.wait_idle()
    await assert_applied_once(env.database_url, ids)
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 400


def _expiration_s(message: AbstractIncomingMessage) -> float | None:
    """A message's per-message expiration in seconds (aio-pika decodes the milliseconds)."""
    value = message.expiration
    assert value is None or isinstance(value, float), value
    return value


async def _applied(env: TestEnv, event_id: uuid.UUID) -> bool:
    return await effects(env, event_id) >= 1


async def _count(env: TestEnv, query: str, expected: int) -> bool:
    return int(await fetchval(env.database_url, query)) >= expected


async def test_a_missing_grant_stops_the_service_instead_of_dead_lettering(
    env: TestEnv, admin_dsn: str
) -> None:
    # Given a database role that may write receipts but not the handler's own table
    role = f"{env.name}_limited"
    database = env.database_url.rsplit("/", 1)[1]
    conn = await asyncpg.connect(env.database_url)
    try:
        await conn.execute(f'CREATE ROLE "{role}" LOGIN')
        await conn.execute(f'GRANT CONNECT ON DATABASE "{database}" TO "{role}"')
        await conn.execute(f'GRANT SELECT, INSERT ON receipts, handler_calls TO "{role}"')
        # Receipts of before their partitioning are read, never written (sql/005).
        await conn.execute(f'GRANT SELECT ON receipts_legacy TO "{role}"')
        await conn.execute(f'GRANT SELECT ON test_effects TO "{role}"')
        # consumer run checks no migration is pending (sql/006 grants consumer_app the same).
        await conn.execute(f'GRANT SELECT ON consumer_migrations TO "{role}"')
        limited = env.database_url.replace("postgres@", f"{role}@")
        await env.apply_topology()
        service = ServiceProcess(env, database_url=limited).start()
        await service.wait_ready()
        async with env.producer() as producer:
            event_id = await producer.send("test.behave", behave("forbidden"))

        # When the handler hits the missing grant, the service stops with one clear line
        assert await service.wait_exit(timeout=30) == 1
        assert "permission denied for table test_effects (a grant is missing)" in service.log_text()
        # And the event is neither applied nor dead-lettered: it waits for the fix
        assert await queue_depth(env.amqp_url, env.names.dead) == 0
        assert await effects(env, event_id) == 0
        assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 0
    finally:
        await conn.execute(f'REVOKE ALL ON ALL TABLES IN SCHEMA public FROM "{role}"')
        await conn.execute(f'REVOKE ALL ON DATABASE "{database}" FROM "{role}"')
        await conn.close()
        env.kill_processes()
        admin = await asyncpg.connect(admin_dsn)
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()
