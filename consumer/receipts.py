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

from consumer.database import Guard
from consumer.envelope import Envelope
from consumer.errors import ErrorKind, PipelineFault, classify

__all__ = ["Receipts"]

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

    async def exists(self, conn: asyncpg.Connection[Any], event_id: UUID) -> bool:
        query = conn.fetchval(_EXISTS, self._consumer, event_id)
        return bool(await self._guard.run(conn, query))


def _stop_if_broken(error: Exception) -> None:
    if classify(error) is ErrorKind.PERMANENT:
        # Not the event's fault: the receipts table itself is broken or missing.
        raise PipelineFault(f"cannot write receipts: {error}") from error
