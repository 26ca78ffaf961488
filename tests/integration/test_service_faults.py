"""Faults inside the service process itself: a channel closing under an operation, a worker that
dies. Injected by tests/handlers/sabotage.py, a handler module that patches the real service."""

from __future__ import annotations

import uuid

import pytest

from tests.support import TEST_HANDLERS, ServiceProcess, TestEnv, fetchval, wait_until

HANDLERS = f"{TEST_HANDLERS},tests.handlers.sabotage"


@pytest.fixture
def own(env: TestEnv) -> TestEnv:
    """The test's env, with the sabotage module among its handlers."""
    env.overrides["handlers"] = HANDLERS
    return env


def sabotaged(env: TestEnv, label: str, what: str) -> ServiceProcess:
    service = ServiceProcess(env, label)
    service.environment["TEST_SABOTAGE"] = what
    return service


async def effects(env: TestEnv, event_id: uuid.UUID) -> int:
    return int(
        await fetchval(
            env.database_url, "SELECT count(*) FROM test_effects WHERE event_id = $1", event_id
        )
    )


async def test_a_channel_closing_under_basic_consume_is_a_reconnect_not_a_crash(
    own: TestEnv,
) -> None:
    # Given a service whose first basic.consume fails as aiormq fails it on a closing channel
    env = own
    await env.apply_topology()
    service = sabotaged(env, "service", "start_consuming").start()

    # Then it reconnects and goes on, instead of crashing
    await service.wait_ready()
    async with env.producer() as producer:
        event_id = await producer.send("test.sabotage", {"key": "after"})

    async def applied() -> bool:
        return await effects(env, event_id) == 1

    await wait_until(applied, what="an event after the reconnect")
    lost = [line for line in service.log_lines() if line.get("event") == "lost RabbitMQ"]
    assert [line["error"] for line in lost] == ["writer is None"]
    assert await service.stop() == 0


async def test_a_worker_that_dies_stops_the_service_with_one_line_and_nothing_is_lost(
    own: TestEnv,
) -> None:
    # Given a bug outside the handled exceptions that kills the worker settling an event
    env = own
    await env.apply_topology()
    service = await sabotaged(env, "sabotaged", "report").start().wait_ready()
    async with env.producer() as producer:
        event_id = await producer.send("test.sabotage", {"key": "k"})

    # Then the process exits non-zero, saying which worker died of what, instead of running on
    # with an inbox nobody serves
    assert await service.wait_exit(timeout=30) == 1
    [died] = [
        line
        for line in service.log_lines()
        if line.get("event") == "a worker stopped on an unexpected error"
    ]
    assert died["error_class"] == "ZeroDivisionError"
    assert "ZeroDivisionError" in died["traceback"]

    # And a restarted service (no sabotage) settles the event: applied once
    healthy = await ServiceProcess(env, "healthy").start().wait_ready()

    async def applied() -> bool:
        return await effects(env, event_id) == 1

    await wait_until(applied, what="the event after the restart")
    assert await healthy.metric("consumer_in_flight") == 0
    assert await healthy.stop() == 0


async def test_a_redelivered_copy_of_a_committed_event_whose_ack_was_lost_is_not_applied_again(
    own: TestEnv,
) -> None:
    # Given a service that commits an event and loses its ack: the connection closes between the
    # commit and the ack, so the broker holds the delivery unacked and gives it back, redelivered
    env = own
    await env.apply_topology()
    service = await sabotaged(env, "service", "ack_lost").start().wait_ready()
    async with env.producer() as producer:
        event_id = await producer.send("test.sabotage", {"key": "once"})

    # Then the redelivered copy takes the redelivery path (isolated, marked in progress), finds
    # the receipt its first copy committed, and is acked as a duplicate: one effect
    async def settled_as_duplicate() -> bool:
        return await service.metric_is(
            "consumer_messages_total", 1, type="test.sabotage", outcome="duplicate"
        )

    await wait_until(settled_as_duplicate, what="the redelivered copy settled as a duplicate")
    await service.wait_idle()
    assert await effects(env, event_id) == 1
    assert await service.metric("consumer_redeliveries_total") == 1
    assert (
        await service.metric("consumer_messages_total", type="test.sabotage", outcome="processed")
        == 1
    )
    lost = [line for line in service.log_lines() if line.get("event") == "lost RabbitMQ"]
    assert len(lost) == 1, lost
    marks = await fetchval(env.database_url, "SELECT count(*) FROM consumer_in_progress")
    assert marks == 0
    assert await service.stop() == 0
