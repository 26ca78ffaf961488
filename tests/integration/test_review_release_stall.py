"""Review finding: a pooled connection given back to a stalled PostgreSQL. The release may talk
to the server (asyncpg rolls back and cancels what a cancelled statement left), so it has a time
limit of its own; without one a worker cancelled mid-COMMIT at shutdown never ended, and the
service with it."""

from __future__ import annotations

import asyncio

from pydantic import SecretStr

from consumer.db.database import ACQUIRE_TIMEOUT, Database, DatabaseConfig
from consumer.db.guard import guarded_transaction
from tests.servers import ThrowawayPostgres

# Far above the release's limit, far below "for good": a hang, not a speed, is what fails.
ENDS_WITHIN = ACQUIRE_TIMEOUT * 6


async def test_a_worker_cancelled_mid_commit_on_a_frozen_server_ends(
    postgres: ThrowawayPostgres,
) -> None:
    url = postgres.admin_dsn
    database = Database(DatabaseConfig(url=SecretStr(url), safe_url=url, pool_size=1))
    async with database:
        in_transaction = asyncio.Event()

        async def batch() -> None:
            async with (
                database.connection() as conn,
                guarded_transaction(conn, within=60),
            ):
                await conn.execute("SELECT 1")
                # Frozen, not down: the COMMIT that follows gets no answer.
                postgres.freeze()
                in_transaction.set()

        task = asyncio.create_task(batch())
        try:
            await asyncio.wait_for(in_transaction.wait(), timeout=30)
            await asyncio.sleep(0.5)
            # The shutdown's cancel, landing while the COMMIT waits.
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=ENDS_WITHIN)
            assert done, f"the cancelled worker still waits after {ENDS_WITHIN:.0f}s"
            assert task.cancelled()
        finally:
            postgres.thaw()
            if not task.done():
                task.cancel()
        # The release gave up on the frozen connection; the pool has a slot for the next.
        async with database.connection() as conn:
            assert await conn.fetchval("SELECT 1") == 1
