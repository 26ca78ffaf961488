"""A handler's misbehaviour is a fault like SIGKILL: it fails its own event and nothing else.

Effects are counted in ``test_effects``, which has no unique key: a double shows as two rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from typing import Any

import aio_pika
import aiohttp
import asyncpg
import pytest

from consumer.amqp import headers as h
from consumer.pipeline.retry import MAX_CONNECTION_LOSSES
from tests.conftest import make_template
from tests.servers import ThrowawayPostgres
from tests.support import (
    ServiceProcess,
    TestEnv,
    behave,
    drain_queue,
    fetch,
    fetchval,
    queue_depth,
    wait_until,
)

Event = tuple[str, dict[str, Any], uuid.UUID]


def plain(key: str, **spec: Any) -> Event:
    return ("test.behave", behave(key, **spec), uuid.uuid4())


def many(key: str, **spec: Any) -> Event:
    return ("test.behave_many", behave(key, **spec), uuid.uuid4())


async def effects_by_event(env: TestEnv) -> dict[uuid.UUID, int]:
    rows = await fetch(
        env.database_url, "SELECT event_id, count(*) AS n FROM test_effects GROUP BY event_id"
    )
    return {row["event_id"]: row["n"] for row in rows}


async def dead_letters(env: TestEnv, expected: int) -> list[aio_pika.abc.AbstractIncomingMessage]:
    await wait_until(
        lambda: _depth_at_least(env, env.names.dead, expected), what=f"{expected} dead letters"
    )
    await asyncio.sleep(0.5)  # nothing more may follow
    return await drain_queue(env.amqp_url, env.names.dead)


async def _depth_at_least(env: TestEnv, queue: str, expected: int) -> bool:
    return await queue_depth(env.amqp_url, queue) >= expected


def event_id_of(message: aio_pika.abc.AbstractIncomingMessage) -> uuid.UUID:
    return uuid.UUID(json.loads(message.body)["event_id"])


async def all_settled(service: ServiceProcess) -> None:
    """Every delivery received has been acked or nacked once, and nothing is in flight."""

    async def idle() -> bool:
        return await service.metric("consumer_in_flight") == 0

    await wait_until(idle, timeout=15, what="nothing in flight")
    assert await service.metric("consumer_settled_twice_total") == 0


@pytest.mark.parametrize("batch_size", ["50", "1"])
async def test_a_swallowed_database_error_fails_only_its_own_event(
    env: TestEnv, batch_size: str
) -> None:
    # Given handlers that write "insert or ignore" the wrong way (catching the unique violation
    # with no savepoint, which aborts the transaction), in the middle of batches of innocent
    # events, for a plain handler and a batch handler
    settings = {"batch_size": batch_size, "db_pool_size": "1"}
    await env.apply_topology(**settings)
    events = [plain(f"i{n}") for n in range(120)] + [many(f"m{n}") for n in range(40)]
    culprits = [plain("s1", swallow=True), plain("s2", swallow=True), plain("s3", swallow=True)]
    culprits += [many("s4", swallow=True), many("s5", swallow=True)]
    for position, culprit in zip((10, 60, 100, 130, 150), culprits, strict=True):
        events.insert(position, culprit)
    async with env.producer() as sender:
        await sender.send_many(events)

    # When the service applies them
    service = await ServiceProcess(env, **settings).start().wait_ready()

    # Then every innocent event is applied exactly once, and each culprit alone is
    # dead-lettered, as permanent, with an error that says how to write it
    letters = await dead_letters(env, len(culprits))
    assert sorted(map(event_id_of, letters)) == sorted(event_id for *_, event_id in culprits)
    for letter in letters:
        assert letter.headers[h.REASON] == "permanent_failure"
        assert letter.headers[h.ERROR_CLASS] == "SwallowedDatabaseError"
        assert "ON CONFLICT DO NOTHING" in str(letter.headers[h.ERROR_MESSAGE])
    innocent = {event_id for *_, event_id in events} - {event_id for *_, event_id in culprits}
    await wait_until(lambda: _effects_at_least(env, len(innocent)), what="the innocent effects")
    assert await effects_by_event(env) == dict.fromkeys(innocent, 1)
    receipts = await fetch(env.database_url, "SELECT event_id FROM receipts")
    assert {row["event_id"] for row in receipts} == innocent
    assert await service.metric("consumer_dead_letters_total", reason="permanent_failure") == len(
        culprits
    )
    await all_settled(service)
    assert await service.stop() == 0


async def _effects_at_least(env: TestEnv, expected: int) -> bool:
    return sum((await effects_by_event(env)).values()) >= expected


@pytest.mark.parametrize("batch_size", ["50", "1"])
async def test_a_handler_that_commits_or_rolls_back_fails_only_its_own_event(
    env: TestEnv, batch_size: str
) -> None:
    # Given handlers that end the service's transaction themselves, among innocent events: a
    # COMMIT would commit the receipts of batch-mates whose handlers have not run yet
    settings = {"batch_size": batch_size, "db_pool_size": "1"}
    await env.apply_topology(**settings)
    events = [plain(f"i{n}") for n in range(40)]
    culprits = [plain("c", end_transaction="commit"), plain("r", end_transaction="rollback")]
    events.insert(10, culprits[0])
    events.insert(30, culprits[1])
    async with env.producer() as sender:
        await sender.send_many(events)

    service = await ServiceProcess(env, **settings).start().wait_ready()

    # Then nothing of theirs commits, the innocent events are each applied once, and the
    # culprits are dead-lettered with a reason that names the mistake
    letters = await dead_letters(env, 2)
    assert sorted(map(event_id_of, letters)) == sorted(event_id for *_, event_id in culprits)
    for letter in letters:
        assert letter.headers[h.ERROR_CLASS] == "HandlerEndedTransaction"
        assert "never end the transaction" in str(letter.headers[h.ERROR_MESSAGE])
    innocent = {event_id for *_, event_id in events} - {event_id for *_, event_id in culprits}
    await wait_until(lambda: _effects_at_least(env, len(innocent)), what="the innocent effects")
    assert await effects_by_event(env) == dict.fromkeys(innocent, 1)
    receipts = await fetch(env.database_url, "SELECT event_id FROM receipts")
    assert {row["event_id"] for row in receipts} == innocent
    await all_settled(service)
    assert await service.stop() == 0


async def test_an_exception_a_validator_raises_is_poison_and_every_delivery_is_settled(
    env: TestEnv,
) -> None:
    # Given a payload validator that raises AttributeError for some payloads (pydantic lets
    # anything but ValueError and AssertionError through), in front of valid events
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()
    bad = uuid.uuid4()
    valid = [("test.odd", {"key": f"v{n}", "name": f"n{n}"}, uuid.uuid4()) for n in range(200)]
    async with env.producer() as sender:
        await sender.send_many([("test.odd", {"key": "bad", "name": 5}, bad), *valid])

    # Then it is dead-lettered as poison with the exception's class, and everything after it is
    # applied and acked: nothing is left unsettled behind it
    [letter] = await dead_letters(env, 1)
    assert event_id_of(letter) == bad
    assert letter.headers[h.REASON] == "invalid_payload"
    assert letter.headers[h.ERROR_CLASS] == "AttributeError"
    await wait_until(lambda: _effects_at_least(env, 200), what="the valid effects")
    assert await effects_by_event(env) == dict.fromkeys([e for *_, e in valid], 1)
    assert await service.metric("consumer_dead_letters_total", reason="invalid_payload") == 1
    await all_settled(service)
    assert await queue_depth(env.amqp_url, env.names.work) == 0
    assert await service.stop() == 0


async def test_an_event_that_breaks_its_connection_each_time_is_dead_lettered(
    env: TestEnv,
) -> None:
    # Given a handler that kills its own database backend on every call, among innocent events
    settings = {"db_pool_size": "1"}
    await env.apply_topology(**settings)
    events = [plain(f"i{n}") for n in range(40)]
    killer = plain("killer", kill_connection=True)
    events.insert(20, killer)
    async with env.producer() as sender:
        await sender.send_many(events)

    service = await ServiceProcess(env, **settings).start().wait_ready()

    # Then after a bounded number of pauses it is dead-lettered with its own reason, and the
    # service goes on: every innocent event applied once
    [letter] = await dead_letters(env, 1)
    assert event_id_of(letter) == killer[2]
    assert letter.headers[h.REASON] == "connection_lost"
    assert letter.headers[h.ERROR_CLASS] == "ConnectionLostRepeatedly"
    await wait_until(lambda: _effects_at_least(env, 40), what="the innocent effects")
    assert await effects_by_event(env) == dict.fromkeys(
        [e for *_, e in events if e != killer[2]], 1
    )
    calls = await fetchval(
        env.database_url, "SELECT count(*) FROM handler_calls WHERE event_id = $1", killer[2]
    )
    assert calls == 1 + MAX_CONNECTION_LOSSES  # once in its batch, then alone each time
    # and no mark of it is left behind: this process lived, and if it died later of something
    # else, a leftover mark would count that death against the killer (then "crashed")
    marks = await fetchval(
        env.database_url, "SELECT count(*) FROM consumer_in_progress WHERE event_id = $1", killer[2]
    )
    assert marks == 0
    await service.wait_ready()
    await all_settled(service)
    assert await service.stop() == 0


async def test_a_duplicate_waiting_for_its_first_copy_is_contention_not_an_outage(
    env: TestEnv,
) -> None:
    # Given an event in a slow handler, and its duplicate arriving meanwhile, with the
    # database-stall guard much shorter than the handler
    settings = {"db_stall_timeout": "1s", "handler_timeout": "10s", "hard_timeout": "15s"}
    await env.apply_topology(**settings)
    service = await ServiceProcess(env, **settings).start().wait_ready()
    slow = plain("slow", sleep_s=4)
    async with env.producer() as sender:
        await sender.send_many([slow])

        async def first_copy_started() -> bool:
            calls = await fetchval(
                env.database_url, "SELECT count(*) FROM handler_calls WHERE event_id = $1", slow[2]
            )
            return int(calls) >= 1

        await wait_until(first_copy_started, what="the first copy's handler")
        await sender.send_many([slow])

        # When the duplicate waits on the first copy's receipt lock for longer than the guard
        paused = False
        for _ in range(50):
            paused = paused or await service.metric("consumer_paused") == 1
            await asyncio.sleep(0.1)

    # Then the service never pauses, and the event is applied once, its duplicate acked
    await wait_until(
        lambda: _outcome_count(service, "duplicate", 1), timeout=30, what="the duplicate"
    )
    assert not paused
    assert not [line for line in service.log_lines() if line.get("event") == "paused"]
    assert await effects_by_event(env) == {slow[2]: 1}
    await all_settled(service)
    assert await service.stop() == 0


async def _outcome_count(service: ServiceProcess, outcome: str, expected: int) -> bool:
    count = await service.metric("consumer_messages_total", type="test.behave", outcome=outcome)
    return count >= expected


async def test_two_copies_in_one_batch_whose_first_fails_leave_one_retry_copy(
    env: TestEnv,
) -> None:
    # Given an event that fails twice, published twice back to back while the only worker is
    # busy with a slow event, so that both copies wait for it and land in one batch (an idle
    # worker would take the first copy alone, at once); the batch size pinned, since a slow
    # handler that only awaits would otherwise be given batches too small to hold both
    settings = {"db_pool_size": "1", "batch_size": "50"}
    await env.apply_topology(**settings)
    service = await ServiceProcess(env, **settings).start().wait_ready()
    slow = plain("slow", sleep_s=2.0)
    flaky = plain("flaky", fail_transient=2)
    async with env.producer() as sender:
        await sender.send_many([slow])

        async def slow_begun() -> bool:
            query = "SELECT count(*) FROM handler_calls WHERE event_id = $1"
            return bool(await fetchval(env.database_url, query, slow[2]))

        await wait_until(slow_begun, what="the slow event's handler to begin")
        await sender.send_many([flaky, flaky, *[plain(f"i{n}") for n in range(10)]])

    # Then one retry copy is published for it at each rung, not one per copy, and the event is
    # applied once: the second copy took the first one's fate
    await wait_until(lambda: _effects_at_least(env, 12), what="the effects")
    await asyncio.sleep(1.5)  # a second retry copy would be back by now
    assert (await effects_by_event(env))[flaky[2]] == 1
    assert await service.metric("consumer_retries_published_total", rung="200ms") == 1
    assert await service.metric("consumer_retries_published_total", rung="400ms") == 1
    calls = await fetchval(
        env.database_url, "SELECT count(*) FROM handler_calls WHERE event_id = $1", flaky[2]
    )
    assert calls == 3
    await all_settled(service)
    assert await service.stop() == 0


async def test_readiness_answers_a_crowd_without_a_crowd_of_backends(env: TestEnv) -> None:
    # Given a ready service
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()
    database = env.database_url.rsplit("/", 1)[1]
    watcher = await asyncpg.connect(env.database_url)
    count_backends = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()"
    )
    before = int(await watcher.fetchval(count_backends, database))
    peak = before
    asking = True

    async def sample() -> None:
        nonlocal peak
        while asking:
            peak = max(peak, int(await watcher.fetchval(count_backends, database)))

    sampling = asyncio.create_task(sample())
    try:
        # When crowds of 30 clients ask /readyz at once, ten times over
        # Ten connections at a time: the endpoint admits only 16 from one address.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=10)) as session:

            async def ask() -> int:
                url = f"http://127.0.0.1:{service.port}/readyz"
                async with session.get(url) as response:
                    return response.status

            for _ in range(10):
                assert await asyncio.gather(*(ask() for _ in range(30))) == [200] * 30
    finally:
        asking = False
        await sampling
        await watcher.close()

    # Then the database saw at most one probe connection at a time
    assert peak <= before + 1
    assert await service.stop() == 0


async def test_pauses_never_hold_more_than_the_prefetch(
    env: TestEnv, postgres: ThrowawayPostgres
) -> None:
    # Given a service on a database that goes away five times while events are in flight
    await make_template(postgres.admin_dsn, "consumer")
    env = dataclasses.replace(env, database_url=postgres.dsn("consumer"))
    settings = {"prefetch": "10", "db_pool_size": "2", "workers": "2", "batch_size": "5"}
    await env.apply_topology(**settings)
    service = await ServiceProcess(env, **settings).start().wait_ready()
    events = [plain(f"e{n}", sleep_s=0.05) for n in range(300)]
    async with env.producer() as sender:
        await sender.send_many(events)
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                peak = max(peak, int(await service.metric("consumer_in_flight")))
            await asyncio.sleep(0.02)

    watching = asyncio.create_task(watch())
    try:
        for _ in range(5):
            await asyncio.sleep(0.7)
            postgres.stop()
            await wait_until(lambda: _metric_is(service, "consumer_paused", 1), what="the pause")
            await asyncio.sleep(0.5)
            postgres.start()
            await wait_until(lambda: _metric_is(service, "consumer_paused", 0), what="the resume")
        await wait_until(lambda: _effects_at_least(env, 300), timeout=120, what="all effects")
    finally:
        watching.cancel()

    # Then the process never held more than the prefetch, and every event applied once
    assert 0 < peak <= 10
    assert await effects_by_event(env) == dict.fromkeys([e for *_, e in events], 1)
    await all_settled(service)
    assert await service.stop() == 0


async def _metric_is(service: ServiceProcess, name: str, value: float) -> bool:
    try:
        return await service.metric(name) == value
    except (aiohttp.ClientError, OSError):
        return False
