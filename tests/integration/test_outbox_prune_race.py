"""The outbox's prune against a writer that commits into an old partition while the prune waits
for the table's lock: the row is kept (sql/009 checks each partition again once locked)."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg

from consumer.outbox import enqueue
from tests.support import TestEnv, wait_until


async def test_a_row_committed_into_an_old_partition_while_a_prune_waits_is_kept(
    env: TestEnv,
) -> None:
    writer = await asyncpg.connect(env.database_url)
    pruner = await asyncpg.connect(env.database_url)
    try:
        # Given a writer's open transaction, holding its lock on the outbox (a row written now)
        transaction = writer.transaction()
        await transaction.start()
        await enqueue(writer, "t.now", {})

        # When a prune with a two-day retention finds the oldest partition without an unsent row
        # and waits for the outbox's lock
        prune = asyncio.create_task(
            pruner.fetch(
                "SELECT partition FROM consumer_outbox_prune("
                "interval '2 days', interval '60 seconds', false)"
            )
        )
        waiting_pid = pruner.get_server_pid()

        async def prune_waits() -> bool:
            waits = await writer.fetchval(
                "SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted", waiting_pid
            )
            return bool(waits)

        await wait_until(prune_waits, what="the prune to wait for the outbox's lock")

        # And the writer puts a row into the oldest of them (the one the prune looked at before
        # it waited), and commits
        await writer.execute(
            "INSERT INTO outbox (event_id, type, body, created_at) "
            "SELECT $1, 't.old', '\\x7b7d'::bytea, min(starts) FROM consumer_outbox_partitions",
            uuid.uuid4(),
        )
        holding = await writer.fetchval(
            "SELECT tableoid::regclass::text FROM outbox WHERE type = 't.old'"
        )
        await transaction.commit()
        dropped = {record["partition"] for record in await prune}

        # Then the prune dropped other old partitions, but not the one holding the unsent row
        assert dropped
        assert holding not in dropped
        assert await writer.fetchval("SELECT count(*) FROM outbox WHERE type = 't.old'") == 1
    finally:
        await writer.close()
        await pruner.close()
