"""What a producer cannot do with the routing key, the event id or the payload's values: have
another type's event applied under its own routing key, suppress another producer's event by
reusing its id, or crash the service with a value its log cannot write.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import aio_pika

from consumer.amqp import headers as h
from consumer.cli.producer import envelope_body
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    drain_queue,
    fetch,
    fetchval,
    queue_depth,
    run_cli,
    wait_until,
)

NOTIFY = "notification.requested"
NOTE = {"recipient": "someone@example.test", "template": "t"}


async def _dead_at_least(env: TestEnv, expected: int) -> bool:
    return await queue_depth(env.amqp_url, env.names.dead) >= expected


async def _effects_at_least(env: TestEnv, expected: int) -> bool:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects")) >= expected


def dlq(env: TestEnv, *args: str) -> tuple[int, str, str]:
    result = run_cli("consumer", "dlq", *args, env=env.env())
    return result.returncode, result.stdout, result.stderr


def dlq_letters(env: TestEnv) -> dict[str, dict[str, Any]]:
    code, out, err = dlq(env, "list", "--json")
    assert code == 0, err
    return {row["id"]: row for row in map(json.loads, out.splitlines())}


# -- the routing key is the type ------------------------------------------------------------------


async def test_a_type_under_another_types_routing_key_is_poison_and_retries_and_replays_pass(
    env: TestEnv,
) -> None:
    # Given the service, and a producer whose topic permission allows only notification.*
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()

    # When it publishes a restock of 500 under notification.requested, among events that climb
    # the retry ladder (back to the work queue by a rung's dead-lettering) or are dead-lettered
    # for good and then replayed
    forged = uuid.uuid4()
    async with env.producer() as producer:
        await producer.send_raw(
            envelope_body("inventory.restock", {"sku": "SKU-1", "qty": 500}, event_id=forged),
            NOTIFY,
        )
        flaky = await producer.send("test.behave", behave("flaky", fail_transient=2))
        phoenix = await producer.send("test.behave", behave("phoenix", fail_transient=4))
    await wait_until(lambda: _effects_at_least(env, 1), what="the flaky event, after two retries")
    await wait_until(lambda: _dead_at_least(env, 2), what="the forged one and the phoenix dead")
    code, out, err = dlq(env, "replay", str(phoenix))
    assert code == 0, err
    await wait_until(lambda: _effects_at_least(env, 2), what="the phoenix, replayed")

    # Then the restock is poison, routing_key_mismatch, and the stock never moved
    assert await fetchval(env.database_url, "SELECT count(*) FROM stock_movements") == 0
    assert await fetchval(env.database_url, "SELECT count(*) FROM stock") == 0
    letters = dlq_letters(env)
    assert letters[str(forged)]["reason"] == "routing_key_mismatch"
    assert "'inventory.restock'" in letters[str(forged)]["error"]
    reason = {"reason": "routing_key_mismatch"}
    assert await service.metric("consumer_dead_letters_total", **reason) == 1
    # And the retried and the replayed events passed the check: each applied once
    await assert_applied_once(env.database_url, [flaky, phoenix])
    assert await service.metric("consumer_retries_published_total", rung="200ms") == 2
    # And a replay keeps the forged letter unless forced: it would go out under its own type
    code, out, err = dlq(env, "replay", str(forged))
    assert code == 1
    assert "routing_key_mismatch" in err
    assert await queue_depth(env.amqp_url, env.names.dead) == 1
    code, out, err = dlq(env, "replay", "--all", "--dry-run")
    assert f"would keep   {forged}: routing_key_mismatch" in out
    assert await service.stop() == 0


# -- an event id is one event's ----------------------------------------------------------------


async def test_an_id_reused_by_another_type_is_dead_lettered_id_conflict_on_every_path(
    env: TestEnv,
) -> None:
    # Given events applied, and the service with one database connection (one worker)
    settings = {"db_pool_size": "1"}
    await env.apply_topology(**settings)
    service = await ServiceProcess(env, **settings).start().wait_ready()
    taken, taken_alone = uuid.uuid4(), uuid.uuid4()
    async with env.producer() as producer:
        for event_id in (taken, taken_alone):
            await producer.send("test.behave", behave(f"k{event_id}"), event_id=event_id)
        await wait_until(lambda: _effects_at_least(env, 2), what="the first events")

        # When, while the worker is busy with a slow event (so that what follows lands in one
        # batch), another producer publishes notifications under those events' ids and
        # occurred_at, a true copy of one comes again, and an id is shared by two new events
        slow = await producer.send("test.behave", behave("slow", sleep_s=2.0))

        async def slow_begun() -> bool:
            query = "SELECT count(*) FROM handler_calls WHERE event_id = $1"
            return bool(await fetchval(env.database_url, query, slow))

        await wait_until(slow_begun, what="the slow event's handler to begin")
        shared = uuid.uuid4()
        await producer.send(NOTIFY, NOTE, event_id=taken)
        await producer.send("test.behave", behave(f"k{taken}"), event_id=taken)
        await producer.send("test.behave", behave("shared"), event_id=shared)
        await producer.send(NOTIFY, NOTE, event_id=shared)
        innocent = [uuid.uuid4() for _ in range(5)]
        await producer.send_many(("test.behave", behave(f"{i}"), i) for i in innocent)
    await wait_until(lambda: _dead_at_least(env, 2), what="two id conflicts")
    await service.wait_idle()

    # Then each notification is dead-lettered id_conflict, with the service's reason, and
    # counted; the true copy is a duplicate; nothing of the notifications was applied
    letters = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    assert [letter.headers[h.REASON] for letter in letters] == ["id_conflict"] * 2
    assert {letter.headers[h.ERROR_CLASS] for letter in letters} == {"IdConflict"}
    assert all("'test.behave'" in str(letter.headers[h.ERROR_MESSAGE]) for letter in letters)
    assert await service.metric("consumer_dead_letters_total", reason="id_conflict") == 2
    duplicate = {"type": "test.behave", "outcome": "duplicate"}
    assert await service.metric("consumer_messages_total", **duplicate) == 1
    assert await fetchval(env.database_url, "SELECT count(*) FROM notifications") == 0
    assert await service.stop() == 0

    # And a redelivered one, applied alone (marked in progress first), is dead-lettered too
    async with env.producer() as producer:
        await producer.send(NOTIFY, NOTE, event_id=taken_alone)
    connection = await aio_pika.connect(env.amqp_url)
    channel = await connection.channel()
    work = await channel.get_queue(env.names.work, ensure=False)
    held = await work.get(no_ack=False, fail=False)
    assert held is not None
    await connection.close()  # unacked: the broker delivers it again, redelivered
    alone = await ServiceProcess(env, label="alone", **settings).start().wait_ready()
    await wait_until(lambda: _dead_at_least(env, 3), what="the third id conflict")
    assert await alone.metric("consumer_dead_letters_total", reason="id_conflict") == 1
    assert await alone.metric("consumer_redeliveries_total") == 1
    assert await fetchval(env.database_url, "SELECT count(*) FROM notifications") == 0
    assert await fetchval(env.database_url, "SELECT count(*) FROM consumer_in_progress") == 0
    await assert_applied_once(env.database_url, [taken, taken_alone, slow, shared, *innocent])
    assert await alone.stop() == 0


# -- logging never raises -------------------------------------------------------------------------


async def test_values_the_log_cannot_write_natively_neither_crash_the_service_nor_lose_events(
    env: TestEnv,
) -> None:
    # Given the service logging payloads
    await env.apply_topology()
    service = await ServiceProcess(env, log_payloads="true").start().wait_ready()

    # When a notification's params carry an integer past 64 bits, and another's a lone surrogate
    # (JSON's "\ud800" escape, which PostgreSQL's jsonb refuses: that one fails for good)
    huge = 2**70
    big, odd = uuid.uuid4(), uuid.uuid4()
    async with env.producer() as producer:
        await producer.send(NOTIFY, {**NOTE, "params": {"n": huge}}, event_id=big)
        await producer.send(NOTIFY, {**NOTE, "params": {"s": "lone \ud800"}}, event_id=odd)
        after = await producer.send("test.behave", behave("after"))
    await wait_until(lambda: _effects_at_least(env, 1), what="the event after them")
    await wait_until(lambda: _dead_at_least(env, 1), what="the one jsonb refuses")
    await service.wait_idle()

    # Then the process still runs, each event was applied once or dead-lettered, and the line of
    # each was written with its payload
    assert service.returncode is None
    await assert_applied_once(env.database_url, [after])
    [row] = await fetch(env.database_url, "SELECT event_id, params FROM notifications")
    assert row["event_id"] == big
    assert json.loads(row["params"]) == {"n": huge}
    settled = {
        line["event_id"]: line
        for line in service.log_lines()
        if line.get("event") == "message settled"
    }
    assert settled[str(big)]["outcome"] == "processed"
    assert settled[str(big)]["payload"]["params"]["n"] == huge
    assert settled[str(odd)]["outcome"] == "dead_lettered"
    assert settled[str(odd)]["payload"]["params"]["s"] == "lone \ud800"
    assert await service.stop() == 0
