"""Second review: the database ends the connections of events in flight (an administrator's
pg_terminate_backend, a fast shutdown), under handlers that translate database errors."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.integration.test_review_base_exceptions import (
    Event,
    all_applied,
    dead_letters,
    own,  # noqa: F401 - the fixture
)
from tests.support import Producer, ServiceProcess, TestEnv, drain_queue, fetch


@pytest.mark.parametrize("batch_size", ["1", "50"])
async def test_terminated_backends_under_a_handler_that_wraps_errors_dead_letter_nothing(
    own: TestEnv,  # noqa: F811
    batch_size: str,
) -> None:
    env = own
    settings = {"batch_size": batch_size, "db_pool_size": "2"}
    await env.apply_topology(**settings)
    events: list[Event] = [
        ("review_base.wrapslow", {"key": f"k{n}"}, uuid.uuid4()) for n in range(6)
    ]
    service = await ServiceProcess(env, **settings).start().wait_ready()
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many(events)
    await asyncio.sleep(0.8)
    killed = await fetch(
        env.database_url,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        " AND query LIKE '%pg_sleep%'",
    )
    print("terminated:", len(killed))
    applied = await all_applied(env, events, timeout=40)
    await asyncio.sleep(2)
    dead = dead_letters(await drain_queue(env.amqp_url, env.names.dead))
    print("applied:", applied, "dead:", dead)
    assert killed
    assert not dead, f"innocents dead-lettered: {dead}"
    assert applied
    await service.wait_idle()
    await service.stop()
