"""An event that makes the service itself fail (a bug its handling runs into, not its handler's
error) ends each process it meets: it must be convicted as a process killer is, not loop until
the delivery limit taking its neighbours' deliveries with it.
"""

from __future__ import annotations

import uuid

from tests.integration.test_review_base_exceptions import (
    Event,
    convicted_as_a_crash,
    innocents,
    own,
)
from tests.support import TEST_HANDLERS, Producer, TestEnv

__all__ = ["own"]


async def test_an_event_that_a_service_bug_dies_on_is_convicted_alone(own: TestEnv) -> None:
    env = own
    env.overrides["handlers"] = f"{TEST_HANDLERS},tests.handlers.service_bug"
    settings = {"batch_size": "50", "db_pool_size": "1"}
    await env.apply_topology(**settings)
    culprit: Event = ("service_bug.trip", {"key": "c"}, uuid.uuid4())
    company = innocents(5)
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many([culprit, *company])
    exits = await convicted_as_a_crash(env, settings, culprit, company, exit_within=20)
    assert set(exits) == {1}, exits
