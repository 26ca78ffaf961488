"""Second review: a handler that leaves a task of its own using its connection (checked, sound:
the task meets "another operation is in progress" or a released connection), and one that returns
the exception failing its event instead of raising it (found, fixed)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.integration.test_review_base_exceptions import (
    Event,
    all_applied,
    effects_by_event,
    innocents,
    own,  # noqa: F401 - the fixture
)
from tests.support import Producer, ServiceProcess, TestEnv, drain_queue, fetch


@pytest.mark.parametrize("batch_size", ["1", "50"])
async def test_a_handler_leaving_a_task_on_its_connection_costs_only_itself(
    own: TestEnv,  # noqa: F811
    batch_size: str,
) -> None:
    env = own
    settings = {"batch_size": batch_size, "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit: Event = ("review_base.spawn", {"key": "c"}, uuid.uuid4())
    company = innocents(5)
    service = await ServiceProcess(env, **settings).start().wait_ready()
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([culprit, *company])
    applied = await all_applied(env, company, timeout=20)
    await asyncio.sleep(3)
    effects = await effects_by_event(env)
    letters = await drain_queue(env.amqp_url, env.names.dead)
    print(
        "applied:",
        applied,
        "running:",
        service.running,
        "effects:",
        effects,
        "dead:",
        [
            (m.headers.get("consumer-error-class"), m.headers.get("consumer-error-message"))
            for m in letters
        ],
        service.log_tail(2500),
    )
    assert service.running
    assert applied
    assert all(n == 1 for n in effects.values())
    await service.wait_idle()
    await service.stop()


async def test_a_handler_returning_an_exception_fails_its_event(own: TestEnv) -> None:  # noqa: F811
    """Found in review: ``HandlerCaller.run`` ignored what a handler returned, so one that
    returned the exception failing its event (as a batch handler's results do) was acked as
    processed, its receipt committed with no effect and nothing dead-lettered."""
    env = own
    await env.apply_topology()
    culprit: Event = ("review_base.returns", {"key": "c"}, uuid.uuid4())
    service = await ServiceProcess(env).start().wait_ready()
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([culprit])
    await service.wait_idle()
    receipts = await fetch(env.database_url, "SELECT event_id FROM receipts")
    letters = await drain_queue(env.amqp_url, env.names.dead)
    processed = await service.metric(
        "consumer_messages_total", type="review_base.returns", outcome="processed"
    )
    print("receipts:", receipts, "dead:", len(letters), "processed:", processed)
    await service.stop()
    assert len(letters) == 1, "not dead-lettered"
    assert receipts == [], "a receipt without an effect"
