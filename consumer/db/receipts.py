"""The idempotency receipts: one row per applied event, committed with its effect.

A receipt that already exists means the event's effect does too: its delivery is a duplicate. The
run-time role may only insert and read them (sql/002): the service cannot undo what records an
effect as applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

import asyncpg

from consumer.classification import ErrorKind, classify
from consumer.db.guard import Guard
from consumer.envelope import Envelope
from consumer.errors import EventExpired, IdConflict, PipelineFault

__all__ = ["Receipts", "TransactionLost"]

# Receipts are partitioned by the event's occurred_at (sql/005): every copy of an event carries the
# same one, so it lands in the same partition and the key (consumer, event_id, occurred_at) finds
# it. Receipts written before that migration are in receipts_legacy, read-only, emptied whole once
# older than the retention: an event found there is a duplicate too.
# Each statement that inserts receipts adds how many to a transaction-local count
# (``consumer.receipts``): the seal compares it with the receipts the service believes it inserted.
# A setting made in a transaction or savepoint is undone with it, as the receipts are, and nothing
# else can remove a receipt (the run-time role may only insert them, sql/002): so the count is
# that of the receipts still in the transaction, without reading them again.
_COUNTED = """
, counted AS (
    SELECT set_config(
        'consumer.receipts',
        ((SELECT count(*) FROM inserted)
            + coalesce(nullif(current_setting('consumer.receipts', true), ''), '0')::bigint)::text,
        true
    ) AS total
)
"""

_INSERT_ONE = (
    """
WITH inserted AS (
    INSERT INTO receipts (consumer, event_id, type, occurred_at)
    SELECT $1, $2, $3, $4
    WHERE NOT EXISTS (SELECT FROM receipts_legacy WHERE consumer = $1 AND event_id = $2)
    ON CONFLICT DO NOTHING
    RETURNING true AS fresh
)"""
    + _COUNTED
    + "SELECT fresh, (SELECT total FROM counted) FROM inserted"
)

# Sorted, so concurrent batches take the receipts' row locks in the same order (no deadlock). The
# batch's lock timeout ($5) is set by the statement itself, one round trip fewer than a SET LOCAL
# before it: an uncorrelated subquery in WHERE runs once, before the first row is inserted, so the
# receipts' own lock waits are bounded too, and so is everything after them in the transaction.
_INSERT_MANY = (
    """
WITH inserted AS (
    INSERT INTO receipts (consumer, event_id, type, occurred_at)
    SELECT $1, batch.event_id, batch.type, batch.occurred_at
    FROM unnest($2::uuid[], $3::text[], $4::timestamptz[]) AS batch (event_id, type, occurred_at)
    WHERE (SELECT set_config('lock_timeout', $5, true)) IS NOT NULL AND NOT EXISTS (
        SELECT FROM receipts_legacy AS legacy
        WHERE legacy.consumer = $1 AND legacy.event_id = batch.event_id
    )
    ORDER BY batch.event_id
    ON CONFLICT DO NOTHING
    RETURNING event_id
)"""
    + _COUNTED
    + "SELECT event_id, (SELECT total FROM counted) FROM inserted"
)

# The receipts already there for events whose insert found one (duplicates only: fresh events
# never pay for this), where the receipt is of another type than the event: an event id reused
# across types is a conflict, not a duplicate. Matched on the whole key, as the insert is (the
# legacy table on the event id, as the insert consults it); one index probe per event.
_OTHER_TYPES = """
SELECT copy.event_id, stored.type
FROM unnest($2::uuid[], $3::text[], $4::timestamptz[]) AS copy (event_id, type, occurred_at)
CROSS JOIN LATERAL (
    (SELECT type FROM receipts
     WHERE consumer = $1 AND event_id = copy.event_id AND occurred_at = copy.occurred_at)
    UNION ALL
    (SELECT type FROM receipts_legacy WHERE consumer = $1 AND event_id = copy.event_id)
    LIMIT 1
) AS stored
WHERE stored.type <> copy.type
"""

_EXISTS = """
SELECT EXISTS (SELECT FROM receipts WHERE consumer = $1 AND event_id = $2 AND occurred_at = $3)
"""

# Receipts commit only in a sealed transaction (sql/004): a COMMIT a handler runs is refused. The
# seal is set only if every receipt this transaction inserted is still in it (the count above): a
# handler that rolled the transaction back and began another leaves them gone, and its transaction
# unsealed. In an aborted transaction (a handler swallowed a database error) the seal itself
# fails, where COMMIT would answer ROLLBACK without an error. So nothing is ever taken for
# committed that was not, and no effect commits without its receipt.
_SEAL = """
SELECT CASE WHEN counted.total = $1 THEN set_config('consumer.sealed', 'yes', true) END,
    counted.total
FROM (
    SELECT coalesce(nullif(current_setting('consumer.receipts', true), ''), '0')::bigint AS total
) AS counted
"""

# The count can be lost without the receipts: a handler's RESET ALL (legal in a transaction) puts
# it back to its default. So a count below the receipts expected is checked receipt by receipt
# before the transaction is taken for lost (one above them is never right): matched on the whole
# key (an event id published again with another occurred_at is another event, whose receipt may
# exist already), one index probe per event (OFFSET 0 keeps the planner from making a join of
# it, which in a generic plan could read every receipt of the consumer).
_SEAL_PROBING = """
SELECT set_config('consumer.sealed', 'yes', true)
WHERE (
    SELECT count(*)
    FROM unnest($2::uuid[], $3::timestamptz[]) AS fresh (event_id, occurred_at)
    WHERE EXISTS (
        SELECT FROM receipts
        WHERE consumer = $1 AND event_id = fresh.event_id AND occurred_at = fresh.occurred_at
        OFFSET 0
    )
) = cardinality($2::uuid[])
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
        whose first copy is still being applied waits for it: contention, not a stall.
        :class:`IdConflict` if the receipt there is of another type."""
        query = conn.fetchval(
            _INSERT_ONE, self._consumer, event.event_id, event.type, event.occurred_at
        )
        try:
            fresh = bool(await self._guard.run(conn, query, locks=True))
        except Exception as error:
            _stop_if_broken(error)
            raise
        if not fresh:
            other = await self.other_types(conn, [event])
            if other:
                raise IdConflict.between(event.event_id, event.type, other[event.event_id])
        return fresh

    async def insert_many(
        self, conn: asyncpg.Connection[Any], events: Sequence[Envelope[Any]], *, lock_timeout: str
    ) -> set[UUID]:
        """Insert every receipt of a batch in one statement; the event ids whose receipt is new.
        ``lock_timeout`` (``'100ms'``) bounds every lock wait of the transaction from then on."""
        ids = [event.event_id for event in events]
        types = [event.type for event in events]
        times = [event.occurred_at for event in events]
        query = conn.fetch(_INSERT_MANY, self._consumer, ids, types, times, lock_timeout)
        try:
            rows = await self._guard.run(conn, query, locks=True)
        except Exception as error:
            _stop_if_broken(error)
            raise
        return {row[0] for row in rows}

    async def other_types(
        self, conn: asyncpg.Connection[Any], duplicates: Sequence[Envelope[Any]]
    ) -> dict[UUID, str]:
        """Of ``duplicates`` (events whose receipt the insert found there already), those whose
        receipt is of another type: event id -> the type the receipt records."""
        if not duplicates:
            return {}
        query = conn.fetch(
            _OTHER_TYPES,
            self._consumer,
            [event.event_id for event in duplicates],
            [event.type for event in duplicates],
            [event.occurred_at for event in duplicates],
        )
        return {row[0]: row[1] for row in await self._guard.run(conn, query)}

    async def seal(self, conn: asyncpg.Connection[Any], fresh: Sequence[Envelope[Any]]) -> None:
        """Seal the transaction for its COMMIT, given the events whose receipts it inserted;
        :class:`TransactionLost` if they are gone, ``asyncpg.InFailedSQLTransactionError`` if a
        handler left it aborted."""
        row = await self._guard.run(conn, conn.fetchrow(_SEAL, len(fresh)))
        assert row is not None  # one row, always
        sealed, counted = row[0], row[1]
        if sealed is None and counted < len(fresh):
            ids = [event.event_id for event in fresh]
            times = [event.occurred_at for event in fresh]
            probe = conn.fetchval(_SEAL_PROBING, self._consumer, ids, times)
            sealed = await self._guard.run(conn, probe)
        if sealed is None:
            raise TransactionLost("the transaction's receipts are gone: a handler ended it")

    async def exists(self, conn: asyncpg.Connection[Any], event: Envelope[Any]) -> bool:
        query = conn.fetchval(_EXISTS, self._consumer, event.event_id, event.occurred_at)
        return bool(await self._guard.run(conn, query))


def _stop_if_broken(error: Exception) -> None:
    if isinstance(error, asyncpg.CheckViolationError):
        # No partition takes the receipt: its range was dropped, the event is too old to apply
        # (its expiry check passed on a clock ahead of the database's, or just before a prune).
        raise EventExpired(
            f"the database has no receipts for occurred_at this old any more: {error}"
        ) from error
    if classify(error) is ErrorKind.PERMANENT:
        # Not the event's fault: the receipts table itself is broken or missing.
        raise PipelineFault(f"cannot write receipts: {error}") from error
