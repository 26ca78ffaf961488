"""The idempotency receipts: one row per applied event, committed with its effect.

Internal. A receipt that already exists means the event's effect does too: its delivery is a
duplicate. The run-time role may only insert and read them (sql/002): the service cannot undo what
records an effect as applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

import asyncpg

from consumer.envelope import Envelope
from consumer.errors import ErrorKind, PipelineFault, classify
from consumer.guard import Guard

__all__ = ["Receipts", "TransactionLost"]

_INSERT_ONE = """
INSERT INTO receipts (consumer, event_id, type) VALUES ($1, $2, $3)
ON CONFLICT DO NOTHING
RETURNING true
"""

# Sorted, so concurrent batches take the receipts' row locks in the same order (no deadlock).
_INSERT_MANY = """
INSERT INTO receipts (consumer, event_id, type)
SELECT $1, batch.event_id, batch.type
FROM unnest($2::uuid[], $3::text[]) AS batch (event_id, type)
ORDER BY batch.event_id
ON CONFLICT DO NOTHING
RETURNING event_id
"""

_EXISTS = "SELECT EXISTS (SELECT FROM receipts WHERE consumer = $1 AND event_id = $2)"

# Receipts commit only in a sealed transaction (sql/004): a COMMIT a handler runs is refused. The
# seal is set only if every receipt this transaction inserted is still in it: a handler that
# rolled the transaction back and began another leaves them gone, and its transaction unsealed.
# In an aborted transaction (a handler swallowed a database error) the seal itself fails, where
# COMMIT would answer ROLLBACK without an error. So nothing is ever taken for committed that was
# not, and no effect commits without its receipt.
_SEAL = """
SELECT set_config('consumer.sealed', 'yes', true)
WHERE (SELECT count(*) FROM receipts WHERE consumer = $1 AND event_id = ANY($2::uuid[]))
    = cardinality($2::uuid[])
"""


class TransactionLost(Exception):
    """The transaction no longer holds the receipts it inserted: a handler ended it (and perhaps
    began another). Nothing of it may commit."""


class Receipts:
    """The receipts of one service (``consumer``), written through ``guard``."""

    def __init__(self, *, consumer: str, guard: Guard) -> None:
        self._consumer = consumer
        self._guard = guard

    async def insert(self, conn: asyncpg.Connection[Any], event: Envelope[Any]) -> bool:
        """Insert ``event``'s receipt; False if it was there already (a duplicate). A duplicate
        whose first copy is still being applied waits for it: contention, not a stall."""
        query = conn.fetchval(_INSERT_ONE, self._consumer, event.event_id, event.type)
        try:
            return bool(await self._guard.run(conn, query, locks=True))
        except Exception as error:
            _stop_if_broken(error)
            raise

    async def insert_many(
        self, conn: asyncpg.Connection[Any], events: Sequence[Envelope[Any]]
    ) -> set[UUID]:
        """Insert every receipt of a batch in one statement; the event ids whose receipt is new."""
        ids = [event.event_id for event in events]
        types = [event.type for event in events]
        query = conn.fetch(_INSERT_MANY, self._consumer, ids, types)
        try:
            rows = await self._guard.run(conn, query, locks=True)
        except Exception as error:
            _stop_if_broken(error)
            raise
        return {row[0] for row in rows}

    async def seal(self, conn: asyncpg.Connection[Any], fresh: Sequence[UUID]) -> None:
        """Seal the transaction for its COMMIT, given the event ids whose receipts it inserted;
        :class:`TransactionLost` if they are gone, ``asyncpg.InFailedSQLTransactionError`` if a
        handler left it aborted."""
        sealed = await self._guard.run(conn, conn.fetchval(_SEAL, self._consumer, list(fresh)))
        if sealed is None:
            raise TransactionLost("the transaction's receipts are gone: a handler ended it")

    async def exists(self, conn: asyncpg.Connection[Any], event_id: UUID) -> bool:
        query = conn.fetchval(_EXISTS, self._consumer, event_id)
        return bool(await self._guard.run(conn, query))


def _stop_if_broken(error: Exception) -> None:
    if classify(error) is ErrorKind.PERMANENT:
        # Not the event's fault: the receipts table itself is broken or missing.
        raise PipelineFault(f"cannot write receipts: {error}") from error
