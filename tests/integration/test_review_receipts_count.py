"""The receipts' seal compares a transaction-local count (``consumer.receipts``) with the
receipts the service inserted. Found in review: a handler's ``RESET ALL``, legal inside a
transaction, puts that count back to its default (empty): the seal then took the transaction for
one a handler had ended, and a correct event was dead-lettered as ``HandlerEndedTransaction``.

Effects are rows in ``test_effects`` (no unique key: a double shows as two rows).
"""

from __future__ import annotations

import uuid

import pytest

from tests.support import (
    TEST_HANDLERS,
    Producer,
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    fetchval,
    queue_depth,
    wait_until,
)

HANDLERS = f"{TEST_HANDLERS},tests.handlers.review"


@pytest.mark.parametrize("batch_size", ["1", "50"])
async def test_a_handler_that_resets_all_parameters_is_applied_once_not_dead_lettered(
    env: TestEnv, batch_size: str
) -> None:
    # Given events of a handler that runs RESET ALL, between plain ones, in one batch or alone
    env.overrides["handlers"] = HANDLERS
    settings = {"batch_size": batch_size, "db_pool_size": "1"}
    await env.apply_topology(**settings)
    resetting = [("review.reset_all", {"key": f"r{n}"}, uuid.uuid4()) for n in range(2)]
    plain = [("test.behave", behave(f"p{n}"), uuid.uuid4()) for n in range(3)]
    events = [plain[0], resetting[0], plain[1], resetting[1], plain[2]]
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send_many(events)

    # When the service applies them
    service = await ServiceProcess(env, **settings).start().wait_ready()

    async def all_applied() -> bool:
        count = await fetchval(env.database_url, "SELECT count(*) FROM test_effects")
        return int(count) >= len(events)

    async def dead_lettered() -> bool:
        return await queue_depth(env.amqp_url, env.names.dead) > 0

    async def settled() -> bool:
        return await all_applied() or await dead_lettered()

    await wait_until(settled, what="the events applied, or one dead-lettered")

    # Then every one is applied once, and none is dead-lettered
    assert not await dead_lettered(), service.log_tail()
    await assert_applied_once(env.database_url, [event_id for _, _, event_id in events])
    receipts = await fetchval(env.database_url, "SELECT count(*) FROM receipts")
    assert receipts == len(events)
    await env.assert_settled()
