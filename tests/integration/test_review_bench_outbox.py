"""Found in review of the outbox benchmark (issue 34), now a regression test against the real
database.

The defect: ``_latency`` read the rows' ``sent_at - created_at`` as soon as every row had
arrived at the sink. The broker delivers a row before the relay's round marks it (the mark comes
after the last confirm of the round, then the commit), so the last round's rows were often not
marked yet: they were left out of the "confirmed" figures, the slowest ones first."""

from __future__ import annotations

import asyncio

import asyncpg

from bench.outbox import _confirmed_ages
from consumer.outbox import enqueue
from tests.support import TestEnv


async def test_the_confirmed_ages_wait_for_every_row_s_mark(env: TestEnv) -> None:
    conn = await asyncpg.connect(env.database_url)
    try:
        # Given four rows, two of them marked sent
        async with conn.transaction():
            ids = [await enqueue(conn, "bench.relayed", {"n": n}) for n in range(4)]
        mark = "UPDATE outbox SET sent_at = clock_timestamp() WHERE event_id = ANY($1::uuid[])"
        await conn.execute(mark, ids[:2])
        # When the ages are read, and the other two are marked meanwhile
        reading = asyncio.create_task(_confirmed_ages(env.database_url, ids))
        await asyncio.sleep(0.5)
        await conn.execute(mark, ids[2:])
        ages = await reading
    finally:
        await conn.close()
    # Then every row's age is in them
    assert sorted(ages) == sorted(ids)
