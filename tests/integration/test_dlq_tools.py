"""``python -m consumer dlq``: list, show, replay and purge; nothing lost or reordered."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    drain_queue,
    fetchval,
    queue_depth,
    run_cli,
    wait_until,
)


def dlq(env: TestEnv, *args: str, input_text: str | None = None) -> tuple[int, str, str]:
    result = run_cli("consumer", "dlq", *args, env=env.env(), input_text=input_text)
    return result.returncode, result.stdout, result.stderr


def listed(env: TestEnv, *filters: str) -> list[dict[str, Any]]:
    code, out, err = dlq(env, "list", "--json", *filters)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture
async def dead_letters(env: TestEnv) -> dict[str, uuid.UUID]:
    """A service and a DLQ holding: two permanent failures, one exhausted retry, one poison."""
    await env.apply_topology()
    await ServiceProcess(env).start().wait_ready()
    async with env.producer() as producer:
        ids = {
            "unknown_sku": await producer.send(
                "inventory.reserve", {"order_id": "o-1", "sku": "LATER", "qty": 2}
            ),
            "permanent": await producer.send("test.behave", behave("p", permanent=True)),
            "exhausted": await producer.send("test.behave", behave("e", fail_transient=4)),
        }
        await producer.send_raw(b"<xml/>", "test.behave")

    async def four() -> bool:
        return await queue_depth(env.amqp_url, env.names.dead) == 4

    await wait_until(four, timeout=30, what="four dead letters")
    return ids


async def test_list_counts_by_reason_and_type_and_filters(
    env: TestEnv, dead_letters: dict[str, uuid.UUID]
) -> None:
    code, out, _ = dlq(env, "list")
    assert code == 0
    assert "4 dead letters (of 4 in the queue)" in out
    assert "permanent_failure=2" in out
    assert "retries_exhausted=1" in out
    assert "not_json=1" in out
    assert "test.behave=2" in out

    assert {row["id"] for row in listed(env, "--reason", "permanent_failure")} == {
        str(dead_letters["unknown_sku"]),
        str(dead_letters["permanent"]),
    }
    assert [row["id"] for row in listed(env, "--type", "inventory.reserve")] == [
        str(dead_letters["unknown_sku"])
    ]
    assert len(listed(env, "--since", "1h")) == 4
    assert listed(env, "--since", "2999-01-01T00:00:00+00:00") == []
    exhausted = listed(env, "--reason", "retries_exhausted")[0]
    assert exhausted["attempts"] == 3
    assert exhausted["error_class"] == "TransientError"


async def test_browsing_keeps_every_message_in_its_order(
    env: TestEnv, dead_letters: dict[str, uuid.UUID]
) -> None:
    first = [row["id"] for row in listed(env)]
    second = [row["id"] for row in listed(env)]
    assert first == second
    assert await queue_depth(env.amqp_url, env.names.dead) == 4
    in_queue = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    assert len(in_queue) == 4


async def test_show_gives_headers_body_and_for_poison_the_parse_error(
    env: TestEnv, dead_letters: dict[str, uuid.UUID]
) -> None:
    code, out, _ = dlq(env, "show", str(dead_letters["unknown_sku"]))
    assert code == 0
    assert "reason:          permanent_failure" in out
    assert "unknown SKU 'LATER'" in out
    assert "consumer-dead-reason: permanent_failure" in out
    assert '"sku":"LATER"' in out

    poison = next(row for row in listed(env) if row["reason"] == "not_json")
    code, out, _ = dlq(env, "show", poison["id"])
    assert code == 0
    assert "parse error:     Expecting value" in out
    assert "<xml/>" in out

    code, _, err = dlq(env, "show", "no-such-id")
    assert code == 1
    assert "no dead letter with id no-such-id" in err


async def test_replay_applies_a_fixed_event_exactly_once_and_keeps_the_rest(
    env: TestEnv, dead_letters: dict[str, uuid.UUID]
) -> None:
    # Given the cause fixed: the SKU now exists
    async with env.producer() as producer:
        restock = await producer.send("inventory.restock", {"sku": "LATER", "qty": 5})
    await wait_until(lambda: _stock(env, 5), what="the restock")

    code, out, _ = dlq(env, "replay", "--type", "inventory.reserve", "--dry-run")
    assert code == 0
    assert "1 of 4 would be replayed" in out
    assert await queue_depth(env.amqp_url, env.names.dead) == 4

    code, out, _ = dlq(env, "replay", "--type", "inventory.reserve")
    assert code == 0, out
    assert f"replayed {dead_letters['unknown_sku']}" in out
    await wait_until(lambda: _stock(env, 3), what="the replayed reserve")
    await assert_applied_once(
        env.database_url, [restock, dead_letters["unknown_sku"]], "stock_movements"
    )
    assert await queue_depth(env.amqp_url, env.names.dead) == 3


async def test_replay_by_reason_replays_only_that_reason(
    env: TestEnv, dead_letters: dict[str, uuid.UUID]
) -> None:
    # Given the cause of the permanent failure fixed too (its SKU exists now): only the
    # selection keeps it from being replayed and applied
    async with env.producer() as producer:
        await producer.send("inventory.restock", {"sku": "LATER", "qty": 5})
    await wait_until(lambda: _stock(env, 5), what="the restock")

    # When the exhausted retries are replayed
    code, out, err = dlq(env, "replay", "--reason", "retries_exhausted")

    # Then only the exhausted event is replayed, and applied once (its fifth call succeeds)
    assert code == 0, err
    assert _replayed(out) == [str(dead_letters["exhausted"])]
    await wait_until(lambda: _effects_are(env, 1), what="the replayed event applied")
    await assert_applied_once(env.database_url, [dead_letters["exhausted"]])
    # And the other three stay, the fixed reserve among them, unapplied
    assert {row["id"] for row in listed(env)} == {
        str(dead_letters["unknown_sku"]),
        str(dead_letters["permanent"]),
        next(row["id"] for row in listed(env, "--reason", "not_json")),
    }
    assert await queue_depth(env.amqp_url, env.names.dead) == 3
    assert await _stock(env, 5)


async def test_replay_since_a_time_replays_only_what_died_after_it(env: TestEnv) -> None:
    # Given two reserves dead-lettered (their SKU did not exist), then, later, two more
    await env.apply_topology()
    await ServiceProcess(env).start().wait_ready()
    reserve = {"order_id": "o", "qty": 1}
    async with env.producer() as producer:
        older = [await producer.send("inventory.reserve", {**reserve, "sku": "OLD"}) for _ in "ab"]
    await wait_until(lambda: _dead_are(env, 2), what="the first two dead letters")
    boundary = datetime.now(UTC)
    async with env.producer() as producer:
        newer = [await producer.send("inventory.reserve", {**reserve, "sku": "NEW"}) for _ in "ab"]
        await wait_until(lambda: _dead_are(env, 4), what="the next two dead letters")
        # and both SKUs restocked: every one of them would now apply
        restocks = [
            await producer.send("inventory.restock", {"sku": sku, "qty": 10})
            for sku in ("OLD", "NEW")
        ]
    await wait_until(lambda: _receipts(env, 2), what="the restocks")

    # When what died since the boundary is replayed
    code, out, err = dlq(env, "replay", "--since", boundary.isoformat())

    # Then only the two newer ones are replayed and applied, once each; the older two stay
    assert code == 0, err
    assert sorted(_replayed(out)) == sorted(str(event_id) for event_id in newer)
    await wait_until(lambda: _receipts(env, 4), what="the replayed reserves")
    await assert_applied_once(env.database_url, [*restocks, *newer], "stock_movements")
    assert {row["id"] for row in listed(env)} == {str(event_id) for event_id in older}
    assert await fetchval(env.database_url, "SELECT available FROM stock WHERE sku = 'OLD'") == 10
    assert await fetchval(env.database_url, "SELECT available FROM stock WHERE sku = 'NEW'") == 8


async def test_replaying_the_same_event_twice_applies_it_once(env: TestEnv) -> None:
    await env.apply_topology()
    await ServiceProcess(env).start().wait_ready()
    event_id = uuid.uuid4()
    async with env.producer() as producer:
        for _ in range(2):  # the producer sent it twice; both copies failed permanently
            await producer.send(
                "inventory.reserve", {"order_id": "o", "sku": "S", "qty": 1}, event_id=event_id
            )

    async def two() -> bool:
        return await queue_depth(env.amqp_url, env.names.dead) == 2

    await wait_until(two, what="two dead copies")
    async with env.producer() as producer:
        restock = await producer.send("inventory.restock", {"sku": "S", "qty": 10})
    await wait_until(lambda: _stock(env, 10), what="the restock")

    code, out, _ = dlq(env, "replay", "--all")
    assert code == 0
    assert out.count(f"replayed {event_id}") == 2
    await wait_until(lambda: _stock(env, 9), what="the replay")
    await wait_until(lambda: _receipts(env, 2), what="both receipts")
    assert await fetchval(env.database_url, "SELECT available FROM stock WHERE sku = 'S'") == 9
    await assert_applied_once(env.database_url, [restock, event_id], "stock_movements")
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


async def test_replay_needs_a_selection_and_purge_needs_a_terminal_or_yes(
    env: TestEnv, dead_letters: dict[str, uuid.UUID]
) -> None:
    code, _, err = dlq(env, "replay")
    assert code == 2
    assert "say what to replay" in err

    # Without a terminal to ask on (here a pipe), purge needs --yes: one line, exit 2
    code, out, err = dlq(env, "purge", input_text="yes\n")
    assert code == 2
    assert out == ""
    assert err == (
        "error: dlq purge asks before deleting and there is no terminal to ask on: add --yes\n"
    )
    assert await queue_depth(env.amqp_url, env.names.dead) == 4

    code, out, _ = dlq(env, "purge", "--yes")
    assert code == 0
    assert f"purged 4 messages from {env.names.dead}" in out
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


async def _stock(env: TestEnv, expected: int) -> bool:
    available = await fetchval(env.database_url, "SELECT max(available) FROM stock")
    return bool(available == expected)


def _replayed(out: str) -> list[str]:
    """The ids ``dlq replay`` says it replayed (``replayed <id> -> <event type>``)."""
    return re.findall(r"^replayed (\S+) -> ", out, flags=re.MULTILINE)


async def _effects_are(env: TestEnv, expected: int) -> bool:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects")) == expected


async def _dead_are(env: TestEnv, expected: int) -> bool:
    return await queue_depth(env.amqp_url, env.names.dead) == expected


async def _receipts(env: TestEnv, expected: int) -> bool:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM receipts")) >= expected
