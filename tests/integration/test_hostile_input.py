"""No input can crash the service or sneak an effect through."""

from __future__ import annotations

import json
import random
import uuid
from datetime import UTC, datetime
from typing import Any

from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    fetch,
    fetchval,
    queue_depth,
    wait_until,
)

NASTY = [
    "'; DROP TABLE stock; --",
    '" OR 1=1 --',
    "Robert'); DELETE FROM receipts;--",
    "$1 $2 ::uuid",
    "\\x00\\'\\\"",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃",
    "%s%s%s%n",
    "<script>alert(1)</script>",
]


def valid_envelope(event_type: str, payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "event_id": str(uuid.uuid4()),
        "type": event_type,
        "occurred_at": datetime.now(UTC).isoformat(),
        "payload": payload,
    }


def hostile_bodies(rng: random.Random, count: int) -> list[tuple[bytes, str, dict[str, Any]]]:
    """``count`` bodies, each of which must end in the DLQ: (body, routing key, publish options)."""
    crafted: list[tuple[bytes, str, dict[str, Any]]] = []
    good = json.dumps(valid_envelope("test.behave", {"key": "k"})).encode()
    variants: list[Any] = [
        lambda: rng.randbytes(rng.randrange(0, 300)),
        lambda: good[: rng.randrange(1, len(good) - 1)],
        lambda: good.replace(b'"type"', b'"type": "test.behave", "type"'),
        lambda: ("[" * rng.randrange(40, 3000) + "]" * 10).encode(),
        lambda: json.dumps({**json.loads(good), "extra": 1}).encode(),
        lambda: json.dumps({**json.loads(good), "event_id": rng.choice(NASTY)}).encode(),
        lambda: json.dumps({**json.loads(good), "occurred_at": "2026-11-29T10:00:00"}).encode(),
        lambda: json.dumps({**json.loads(good), "occurred_at": "3026-11-29T10:00:00Z"}).encode(),
        lambda: json.dumps({**json.loads(good), "type": "test.unknown"}).encode(),
        lambda: json.dumps({**json.loads(good), "payload": {"key": ""}}).encode(),
        lambda: json.dumps({**json.loads(good), "payload": [rng.choice(NASTY)]}).encode(),
        lambda: good.replace(b'"k"', b"NaN"),
        lambda: b"\xef\xbb\xbf" + good,
        lambda: good.replace(b'"k"', b'"\xff\xfe"'),
        lambda: ("1" * rng.randrange(5000, 6000)).encode(),
        lambda: json.dumps(rng.choice([None, True, 3.5, "text", [], {}])).encode(),
        lambda: b"x" * 5000,
    ]
    for number in range(count):
        options: dict[str, Any] = {}
        kind = number % (len(variants) + 3)
        if kind == len(variants):
            body, options = good, {"content_type": "text/plain"}
        elif kind == len(variants) + 1:
            body, options = good, {"content_encoding": "gzip"}
        elif kind == len(variants) + 2:
            body, options = good, {"headers": {"blob": "h" * 70_000}}
        else:
            body = variants[kind]()
        crafted.append((body, rng.choice(["test.behave", "inventory.reserve"]), options))
    return crafted


async def test_five_thousand_hostile_bodies_all_dead_lettered_and_valid_events_applied(
    env: TestEnv,
) -> None:
    # Given a running service with a small body limit
    await env.apply_topology()
    service = await ServiceProcess(env, max_body_bytes="4096").start().wait_ready()
    rng = random.Random(20261129)
    hostile = hostile_bodies(rng, 5000)
    valid: list[dict[str, Any]] = []
    for number in range(200):
        nasty = NASTY[number % len(NASTY)]
        if number % 2:
            valid.append(valid_envelope("test.behave", {"key": f"{nasty} #{number}"}))
        else:
            params = {"quote": nasty, "n": number, nasty: [nasty]}
            payload = {"recipient": nasty, "template": nasty[:100], "params": params}
            valid.append(valid_envelope("notification.requested", payload))

    # When they arrive mixed together
    async with env.producer() as producer:
        pending = list(hostile)
        for envelope in valid:
            for _ in range(25):
                body, routing_key, options = pending.pop()
                await producer.send_raw(body, routing_key, **options)
            await producer.send_raw(json.dumps(envelope).encode(), envelope["type"])
        for body, routing_key, options in pending:
            await producer.send_raw(body, routing_key, **options)

    async def all_settled() -> bool:
        return await queue_depth(env.amqp_url, env.names.dead) >= len(hostile) and int(
            await fetchval(env.database_url, "SELECT count(*) FROM receipts")
        ) >= len(valid)

    await wait_until(all_settled, timeout=180, what="every message settled")
    await service.wait_idle()

    # Then the service is still the same process, every hostile body is dead-lettered, and
    # exactly the valid events have receipts and effects, their strings stored verbatim
    assert service.returncode is None
    assert await queue_depth(env.amqp_url, env.names.dead) == len(hostile)
    assert await queue_depth(env.amqp_url, env.names.work) == 0
    receipts = {
        str(r["event_id"]) for r in await fetch(env.database_url, "SELECT event_id FROM receipts")
    }
    assert receipts == {envelope["event_id"] for envelope in valid}
    by_type = {
        table: [uuid.UUID(e["event_id"]) for e in valid if e["type"] == event_type]
        for table, event_type in (
            ("test_effects", "test.behave"),
            ("notifications", "notification.requested"),
        )
    }
    for table, ids in by_type.items():
        await assert_applied_once(env.database_url, ids, table)
    effects = await fetch(env.database_url, "SELECT event_id, key FROM test_effects")
    notifications = await fetch(
        env.database_url, "SELECT event_id, recipient, params FROM notifications"
    )
    assert len(effects) + len(notifications) == len(valid)
    by_id = {envelope["event_id"]: envelope for envelope in valid}
    for row in effects:
        assert row["key"] == by_id[str(row["event_id"])]["payload"]["key"]
    for row in notifications:
        sent = by_id[str(row["event_id"])]["payload"]
        assert row["recipient"] == sent["recipient"]
        assert json.loads(row["params"]) == sent["params"]
    assert await fetchval(env.database_url, "SELECT count(*) FROM stock") == 0
    poison = 0.0
    for event_type in ("unknown", "test.behave", "inventory.reserve"):
        poison += await service.metric("consumer_messages_total", type=event_type, outcome="poison")
    assert poison == len(hostile)
