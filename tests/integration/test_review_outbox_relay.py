"""Found in review of the outbox relay (issue 34), now regression tests against the real broker
and database. Each test names the defect it was written for."""

from __future__ import annotations

import asyncpg

from tests.integration.test_outbox_relay import enqueue, failed_once, relay, sent
from tests.support import TestEnv, drain_queue, wait_until


async def test_a_row_whose_headers_amqp_cannot_carry_fails_for_good_and_frees_its_key(
    env: TestEnv,
) -> None:
    # The defect: a header value AMQP has no type for (an integer past 64 bits, which JSON and
    # jsonb take) made every publish of the row raise the encoder's TypeError, which the relay
    # counted as a transient failure: the row was tried again for ever, and every later row of its
    # key was held behind it for ever.
    await env.apply_topology()
    async with relay(env) as metrics:
        conn = await asyncpg.connect(env.database_url)
        try:
            # Given a row of key K whose header no AMQP table can hold, and a row of K after it
            bad = await enqueue(conn, {"sku": "A", "qty": 1}, key="K", headers={"n": 2**70})
            after = await enqueue(conn, {"sku": "B", "qty": 1}, key="K")
            # Then the row after it is sent
            await wait_until(lambda: sent(env, after), what="the row after the unsendable one")
            # and the unsendable one is failed for good, its reason kept, never published
            error = await failed_once(conn, bad)
        finally:
            await conn.close()
        assert "Unsupported numeric value" in error
        assert metrics.outbox_refused.labels(kind="permanent")._value.get() == 1
    messages = await drain_queue(env.amqp_url, env.names.work)
    assert [message.message_id for message in messages] == [str(after)]
