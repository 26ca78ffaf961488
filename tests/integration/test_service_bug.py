"""An event that makes the service itself fail (a bug its handling runs into, not its handler's
error) ends each process it meets: it must be convicted as a process killer is, not loop until
the delivery limit taking its neighbours' deliveries with it.
"""

from __future__ import annotations

import uuid

from tests.integration.test_review_base_exceptions import (
    Event,
    all_applied,
    innocents,
    own,
    until_dead,
)
from tests.support import TEST_HANDLERS, Producer, ServiceProcess, TestEnv

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
    exits: list[int] = []
    survivor: ServiceProcess | None = None
    for run in range(6):
        service = ServiceProcess(env, label=f"run{run}", **settings).start()
        try:
            exits.append(await service.wait_exit(timeout=20))
        except AssertionError:
            survivor = service
            break
    assert survivor is not None, f"every process died: {exits}"
    assert exits, "no process died: the judge was not patched"
    assert set(exits) == {1}, exits
    assert len(exits) <= 3, f"the culprit was not convicted in time: {exits}"
    dead = await until_dead(env, culprit[2])
    assert set(dead) == {culprit[2]}, "an innocent was dead-lettered"
    assert dead[culprit[2]][0] == "crashed", (exits, dead)
    assert await all_applied(env, company, timeout=15)
    await survivor.wait_ready()
    await survivor.wait_idle()
    await survivor.stop()
