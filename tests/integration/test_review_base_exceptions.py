"""Found in the second review, now regression tests: handlers that raise what is not an
``Exception`` (``BaseException`` subclasses), and a handler ``key`` that is not hashable. Each
held deliveries for ever or looped a process instead of failing the culprit alone.

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
    wait_until,
)

HANDLERS = f"{TEST_HANDLERS},tests.handlers.review_base"
Event = tuple[str, dict[str, Any], uuid.UUID]


@pytest.fixture
def own(env: TestEnv) -> TestEnv:
    """The test's env with these handlers (its ingress exchange, `<name>.events`, is the env's own
    and goes with its topology)."""
    env.overrides["handlers"] = HANDLERS
    return env


async def effects_by_event(env: TestEnv) -> dict[uuid.UUID, int]:
    rows = await fetch(
        env.database_url, "SELECT event_id, count(*) AS n FROM test_effects GROUP BY event_id"
    )
    return {row["event_id"]: row["n"] for row in rows}


def innocents(count: int) -> list[Event]:
    return [("test.behave", behave(f"innocent{n}"), uuid.uuid4()) for n in range(count)]


async def all_applied(env: TestEnv, events: list[Event], timeout: float) -> bool:
    async def applied() -> bool:
        effects = await effects_by_event(env)
        return all(effects.get(event_id) == 1 for *_, event_id in events)

    try:
        await wait_until(applied, timeout=timeout, what="innocents applied")
    except AssertionError:
        return False
    return True


async def make_redelivered(env: TestEnv, count: int) -> None:
    """Take ``count`` messages from the work queue without acking, then close: the broker
    returns them flagged redelivered, as after a process died holding them."""
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=count)
        queue = await channel.get_queue(env.names.work, ensure=False)
        got = 0
        while got < count:
            message = await queue.get(no_ack=False, fail=False, timeout=5)
            if message is None:
                await asyncio.sleep(0.1)
                continue
            got += 1
    finally:
        await connection.close()


def dead_letters(
    letters: list[aio_pika.abc.AbstractIncomingMessage],
) -> dict[uuid.UUID, tuple[str, str]]:
    return {
        uuid.UUID(json.loads(m.body)["event_id"]): (
            str(m.headers.get(h.REASON)),
            str(m.headers.get(h.ERROR_CLASS)),
        )
        for m in letters
    }


async def until_dead(
    env: TestEnv, event_id: uuid.UUID, timeout: float = 15
) -> dict[uuid.UUID, tuple[str, str]]:
    """The dead-letter queue's letters (drained) once ``event_id`` is among them."""
    seen: dict[uuid.UUID, tuple[str, str]] = {}

    async def there() -> bool:
        seen.update(dead_letters(await drain_queue(env.amqp_url, env.names.dead)))
        return event_id in seen

    await wait_until(there, timeout=timeout, what="the culprit dead-lettered")
    return seen


async def convicted_as_a_crash(
    env: TestEnv,
    settings: dict[str, str],
    culprit: Event,
    company: list[Event],
    *,
    exit_within: float,
) -> list[int]:
    """Start a process whenever the last one exited, as a supervisor would (at most 6): the
    culprit must be dead-lettered ``crashed`` within 3 deaths, alone, and ``company`` applied.
    Returns the exit codes."""
    exits: list[int] = []
    survivor: ServiceProcess | None = None
    for run in range(6):
        service = ServiceProcess(env, label=f"run{run}", **settings).start()
        try:
            exits.append(await service.wait_exit(timeout=exit_within))
        except AssertionError:
            survivor = service
            break
    assert survivor is not None, f"every process died: {exits}"
    assert len(exits) <= 3, f"the culprit was not convicted in time: {exits}"
    dead = await until_dead(env, culprit[2])
    assert dead[culprit[2]][0] == "crashed", (exits, dead)
    assert set(dead) == {culprit[2]}, "an innocent was dead-lettered"
    assert await all_applied(env, company, timeout=15)
    await survivor.wait_ready()
    await survivor.wait_idle()
    await survivor.stop()
    return exits


@pytest.mark.parametrize("escape", ["cancelled", "generator_exit", "base"])
async def test_a_base_exception_from_a_handler_in_a_batch_fails_its_event_alone(
    own: TestEnv, escape: str
) -> None:
    """Found in review: ``calls._call`` caught ``Exception`` only. A ``CancelledError`` a handler
    raised (awaiting a future or task some library cancelled) ended its worker task as
    "cancelled", which ``WorkerTasks._task_ended`` ignores: that batch and every later delivery
    routed to the worker's inbox were never settled, while ``/healthz`` stayed 200. Any other
    ``BaseException`` (``GeneratorExit``, a library's own) stopped the process "gracefully", which
    clears its crash marks: every process died on the event until the broker's delivery limit
    (5 restarts, 5 deaths, no mark, no dead letter). Now it is the event's permanent failure."""
    env = own
    settings = {"batch_size": "50", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit: Event = ("review_base.escape", {"key": "c", "escape": escape}, uuid.uuid4())
    before = innocents(3)
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([*before, culprit])
    service = await ServiceProcess(env, **settings).start().wait_ready()
    later = innocents(3)
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many(later)
    assert await all_applied(env, [*before, *later], timeout=20), "innocents not applied"
    dead = await until_dead(env, culprit[2])
    assert dead == {culprit[2]: ("permanent_failure", "HandlerRaisedBaseException")}
    assert culprit[2] not in await effects_by_event(env)  # its write was rolled back
    assert service.running
    assert await service.is_ready()
    await service.wait_idle()
    await service.stop()


async def test_a_cancelled_error_from_a_handler_applied_alone_fails_its_event_alone(
    own: TestEnv,
) -> None:
    """Found in review: the same ``CancelledError`` in the lane (a redelivered event, applied
    alone) ended the lane task silently, and the service never became ready: every redelivered
    delivery behind it was never applied nor settled."""
    env = own
    settings = {"batch_size": "50", "db_pool_size": "2"}
    await env.apply_topology(**settings)
    culprit: Event = ("review_base.escape", {"key": "c", "escape": "cancelled"}, uuid.uuid4())
    after = innocents(3)
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([culprit, *after])
    await make_redelivered(env, 4)
    service = ServiceProcess(env, **settings).start()
    assert await all_applied(env, after, timeout=30), "redelivered innocents not applied"
    dead = await until_dead(env, culprit[2])
    assert dead == {culprit[2]: ("permanent_failure", "HandlerRaisedBaseException")}
    assert await fetch(env.database_url, "SELECT * FROM consumer_in_progress") == []
    await service.wait_ready()
    await service.wait_idle()
    await service.stop()


async def test_an_unhashable_key_costs_only_the_routing(own: TestEnv) -> None:
    """Found in review: ``Dispatcher._route`` hashed the handler's key outside the try of
    ``Prepared.key``: a key that is not hashable (a list, a pydantic model) raised TypeError in
    the consumer callback, which aiormq only logs. The delivery was never placed nor settled and
    held a prefetch slot for ever (``consumer_in_flight`` stayed 1)."""
    env = own
    await env.apply_topology()
    event: Event = ("review_base.listkey", {"key": "k", "tags": ["a", "b"]}, uuid.uuid4())
    service = await ServiceProcess(env).start().wait_ready()
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([event])
    assert await all_applied(env, [event], timeout=15), "never applied"
    await service.wait_idle()
    await service.stop()


async def test_a_permanent_error_with_a_reason_of_its_own_fails_its_event_alone(
    own: TestEnv,
) -> None:
    """Found in review: ``RetryPolicy.decide`` made ``DeadLetterReason(error.reason)`` of any
    PermanentError: a business error with a ``reason`` of its own (``card_declined``) raised
    ValueError inside the judge, which killed the worker; the process exited 1, returning all
    it held (each return counting towards the delivery limit)."""
    env = own
    settings = {"batch_size": "50", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit: Event = ("review_base.escape", {"key": "c", "escape": "declined"}, uuid.uuid4())
    company = innocents(3)
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([*company, culprit])
    service = ServiceProcess(env, **settings).start()
    seen: dict[uuid.UUID, tuple[str, str]] = {}

    async def settled_or_exited() -> bool:
        seen.update(dead_letters(await drain_queue(env.amqp_url, env.names.dead)))
        return not service.running or culprit[2] in seen

    await wait_until(settled_or_exited, timeout=30, what="the culprit settled or an exit")
    code = service.returncode
    print("returncode:", code, "dead:", seen, service.log_tail(1500))
    assert code is None, f"the service exited ({code}) on one event's business error"
    assert seen[culprit[2]][0] == "permanent_failure"
    assert await all_applied(env, company, timeout=10)
    await service.wait_idle()
    await service.stop()


@pytest.mark.parametrize("redelivered", [False, True])
async def test_a_base_exception_from_a_payload_validator_is_poison(
    own: TestEnv, redelivered: bool
) -> None:
    """Found in review: ``Preparer.prepared`` caught ``Exception`` only (DESIGN.md: "parsing
    must catch everything, or a delivery is never settled"). A validator raising a
    ``BaseException`` of a library's own broke the consumer callback (never placed nor settled)
    or, redelivered, the lane."""
    env = own
    settings = {"batch_size": "50", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit: Event = ("review_base.validated", {"key": "abort"}, uuid.uuid4())
    company = innocents(3)
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([culprit, *company])
    if redelivered:
        await make_redelivered(env, 4)
    service = ServiceProcess(env, **settings).start()
    assert await all_applied(env, company, timeout=30), "innocents not applied"
    dead = await until_dead(env, culprit[2])
    assert dead[culprit[2]][0] == "invalid_payload"
    await service.wait_ready()
    await service.wait_idle()
    await service.stop()


async def test_system_exit_from_a_handler_is_a_crash_attributed_to_its_event(
    own: TestEnv,
) -> None:
    """Checked in review, sound: ``SystemExit`` (and ``KeyboardInterrupt``) from a handler still
    end the process, as the handler asked, without the graceful stop that clears crash marks: the
    event is convicted as a process killer is (once in company, twice alone)."""
    env = own
    settings = {"batch_size": "50", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit: Event = ("review_base.escape", {"key": "c", "escape": "system_exit"}, uuid.uuid4())
    company = innocents(3)
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([culprit, *company])
    await convicted_as_a_crash(env, settings, culprit, company, exit_within=15)


async def test_an_error_whose_message_cannot_be_made_fails_its_event_alone(own: TestEnv) -> None:
    """Found in review: ``str()`` of a handler's error was taken unguarded (``_HandlerFailed``,
    the copy's ``consumer-error-message``, the log line): an exception class whose ``__str__``
    raises killed the worker as its event was judged or settled; the process exited 1 at every
    delivery of it (4 of 4), returning all it held, with no crash counted."""
    env = own
    settings = {"batch_size": "50", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit: Event = ("review_base.escape", {"key": "c", "escape": "unprintable"}, uuid.uuid4())
    company = innocents(3)
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([*company, culprit])
    exits: list[int] = []
    survivor: ServiceProcess | None = None
    for run in range(4):
        service = ServiceProcess(env, label=f"run{run}", **settings).start()
        try:
            exits.append(await service.wait_exit(timeout=12))
        except AssertionError:
            survivor = service
            break
    assert survivor is not None, f"every process died on the event: {exits}"
    assert exits == []
    dead = await until_dead(env, culprit[2])
    assert dead[culprit[2]] == ("permanent_failure", "tests.handlers.review_base.Unprintable")
    assert await all_applied(env, company, timeout=15)
    await survivor.wait_ready()
    await survivor.wait_idle()
    await survivor.stop()
