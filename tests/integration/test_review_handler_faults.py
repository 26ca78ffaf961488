"""Found in review, now regression tests. The defects were: handler faults (or legitimate SQL) that
fail or lose an innocent event.

Effects are rows in ``test_effects`` (no unique key).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aio_pika
import pytest

from consumer.amqp import headers as h
from tests.support import (
    TEST_HANDLERS,
    Producer,
    ServiceProcess,
    TestEnv,
    behave,
    drain_queue,
    fetch,
    queue_depth,
    wait_until,
)

HANDLERS = f"{TEST_HANDLERS},tests.handlers.review"
Event = tuple[str, dict[str, Any], uuid.UUID]


@pytest.fixture
def own(env: TestEnv) -> TestEnv:
    """The test's env with these handlers (its ingress exchange, `<name>.events`, is the env's own
    and goes with its topology)."""
    env.overrides["handlers"] = HANDLERS
    return env


def event(event_type: str, key: str, **spec: Any) -> Event:
    return (event_type, {"key": key, **spec}, uuid.uuid4())


async def effects_by_event(env: TestEnv) -> dict[uuid.UUID, int]:
    rows = await fetch(
        env.database_url, "SELECT event_id, count(*) AS n FROM test_effects GROUP BY event_id"
    )
    return {row["event_id"]: row["n"] for row in rows}


async def settle_and_read_dead(
    env: TestEnv, service: ServiceProcess, seconds: float = 8
) -> list[aio_pika.abc.AbstractIncomingMessage]:
    async def idle() -> bool:
        return await service.metric("consumer_in_flight") == 0

    await asyncio.sleep(2)
    await wait_until(idle, timeout=30, what="nothing in flight")
    await asyncio.sleep(seconds)  # retries (200ms, 400ms, 800ms) come and go
    await wait_until(idle, timeout=30, what="nothing in flight")
    return await drain_queue(env.amqp_url, env.names.dead)


def dead_ids(
    letters: list[aio_pika.abc.AbstractIncomingMessage],
) -> dict[uuid.UUID, tuple[str, str]]:
    return {
        uuid.UUID(json.loads(m.body)["event_id"]): (
            str(m.headers.get(h.REASON)),
            str(m.headers.get(h.ERROR_CLASS)),
        )
        for m in letters
    }


async def test_an_innocent_that_wraps_database_errors_is_not_blamed_for_a_swallowed_one(
    own: TestEnv,
) -> None:
    """A batch: a culprit swallows a database error (the transaction is now aborted), then an
    innocent handler meets InFailedSQLTransactionError and, like many handlers, re-raises it as
    an error of its own. ``Pipeline._apply_run`` only looks at the exception's own type, so the
    innocent is blamed (``_HandlerFailed(index)``) and dead-lettered without being run again."""
    env = own
    settings = {"batch_size": "50", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit = ("test.behave", behave("culprit", swallow=True), uuid.uuid4())
    innocent = event("review.wrap", "innocent")
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([culprit, innocent])

    service = await ServiceProcess(env, **settings).start().wait_ready()
    letters = await settle_and_read_dead(env, service)
    dead = dead_ids(letters)
    effects = await effects_by_event(env)
    print("dead:", dead, "effects:", effects)
    await service.stop()
    assert culprit[2] in dead  # the culprit is dead-lettered, as designed
    # Expected: the innocent is applied once and not dead-lettered.
    assert innocent[2] not in dead, f"innocent dead-lettered: {dead[innocent[2]]}"
    assert effects.get(innocent[2]) == 1


@pytest.mark.parametrize("batch_size", ["1", "50"])
async def test_set_constraints_all_immediate_is_named_and_costs_its_batch_nothing(
    own: TestEnv, batch_size: str
) -> None:
    """``SET CONSTRAINTS ALL IMMEDIATE`` fires the deferred commit check of sql/004 at once
    (no deferred check can tell it from a COMMIT), so the contract forbids it: the handler's
    event is dead-lettered with an error that says to name the constraints, and its batch-mates
    are applied once."""
    env = own
    settings = {"batch_size": batch_size, "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit = event("review.immediate", "culprit")
    plain = [("test.behave", behave(f"p{n}"), uuid.uuid4()) for n in range(3)]
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([plain[0], culprit, *plain[1:]])

    service = await ServiceProcess(env, **settings).start().wait_ready()
    letters = await settle_and_read_dead(env, service, seconds=2)
    dead = dead_ids(letters)
    effects = await effects_by_event(env)
    await service.stop()
    assert set(dead) == {culprit[2]}
    [letter] = letters
    assert letter.headers[h.ERROR_CLASS] == "HandlerEndedTransaction"
    assert "SET CONSTRAINTS ALL IMMEDIATE" in str(letter.headers[h.ERROR_MESSAGE])
    assert effects == dict.fromkeys([event_id for *_, event_id in plain], 1)


async def test_a_handler_that_rolls_back_and_begins_again_fails_alone(
    own: TestEnv,
) -> None:
    """A handler that runs ROLLBACK then BEGIN ends "in a transaction", so
    ``Pipeline._handler_call`` does not notice; the seal and COMMIT then commit the handler's
    own transaction, which holds none of the batch's receipts nor the effects of the handlers
    that ran before it. Every event of the batch is acked as applied: the ones before it have
    no effect (lost), the ones after it have an effect without a receipt (a copy applies again)."""
    env = own
    settings = {"batch_size": "50", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    # A slow first event keeps the worker busy while the rest queue up as one batch.
    leader = ("test.behave", behave("leader", sleep_s=1.0), uuid.uuid4())
    before = [("test.behave", behave(f"b{n}"), uuid.uuid4()) for n in range(3)]
    culprit = event("review.restart", "culprit")
    after = [("test.behave", behave(f"a{n}"), uuid.uuid4()) for n in range(3)]
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([leader])
    service = await ServiceProcess(env, **settings).start().wait_ready()
    await asyncio.sleep(0.3)
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([*before, culprit, *after])

    letters = await settle_and_read_dead(env, service, seconds=2)
    dead = dead_ids(letters)
    effects = await effects_by_event(env)
    receipts = {
        row["event_id"] for row in await fetch(env.database_url, "SELECT event_id FROM receipts")
    }
    sizes = [
        row["size"]
        for row in await fetch(env.database_url, "SELECT count(*) AS size FROM handler_calls")
    ]
    depth = await queue_depth(env.amqp_url, env.names.work)
    print("dead:", dead, "effects:", effects, "receipts:", len(receipts), "depth:", depth, sizes)
    # A producer's retry publishes the "after" events again (same event ids).
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many(after)
    await settle_and_read_dead(env, service, seconds=1)
    doubled = {e: n for e, n in (await effects_by_event(env)).items() if n > 1}
    print("doubled after a producer retry:", doubled)
    await service.stop()
    lost = [e[2] for e in before if e[2] not in effects and e[2] not in dead and depth == 0]
    assert not lost, f"{len(lost)} events acked with neither effect nor dead letter"
    assert not doubled, f"{len(doubled)} events applied twice"
